// roundpipe::optim::Adam with bfloat16 master weights and Kahan compensation
// (AdamOptions::kahan_sum): bitwise against a Python reference of Note [Kahan-compensated bf16
// masters] written with torch ops on bf16/fp32 tensors (every ISA, 1 and 2 threads), tracking of an
// fp32-master run over many tiny updates where plain bf16 rounding stalls, plain bf16 masters (no
// compensation) == the float32 step rounded once, bitwise resume through state dicts, and bad input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "optim/adam.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/optim/adam_int8_reference.h"

namespace roundpipe::optim {
namespace {

using roundpipe::testing::TensorMap;

// The reference, from docs/optimizer.md ("Math" and "bf16 masters with Kahan summation"): float32
// scalars as 0-dim tensors (each torch op on two float32 tensors is one IEEE float32 operation,
// except sqrt: see below); fma(a, b, c) emulated in float64 (a*b is exact there; the sum rounds
// twice, which differs from one rounding with probability ~2^-29 per operation).
constexpr const char* kReference = R"PY(
import math
t32 = torch.float32
def S(x):
    return torch.tensor(x, dtype=t32)

def tfma(a, b, c):
    return (a.double() * b.double() + c.double()).float()

def kahan_adam(p16, c16, g, m, v, vmax, step, lr, b1, b2, eps, wd, dec, mx, ams):
    bc1 = 1 - b1 ** step
    bc2 = 1 - b2 ** step
    w = S(1 - b1)
    from_grad = not (abs(w.item()) < 0.5)
    coeff = w - S(1.0) if from_grad else w
    p0 = p16.float()
    p = p0
    g = g.float()
    if mx:
        g = -g
    if wd != 0:
        if dec:
            p = p * S(1 - lr * wd)
        else:
            g = tfma(p, S(wd), g)
    m = tfma(coeff, g - m, g if from_grad else m)
    v = v * S(b2)
    v = v + (S(1 - b2) * g) * g
    vd = v
    if ams:
        vmax = torch.maximum(vmax, v)
        vd = vmax
    # sqrt in float64, rounded once: the correctly rounded float32 sqrt (torch.sqrt on float32
    # CPU tensors goes through MKL's vector math, which is not always correctly rounded).
    denom = torch.sqrt(vd.double()).float() / S(math.sqrt(bc2)) + S(eps)
    s = (S(-(lr / bc1)) * m) / denom
    u = (p - p0) + s if (wd != 0 and dec) else s
    y = u + c16.float()
    p16 = (p0 + y).to(torch.bfloat16)
    c16 = (y - (p16.float() - p0)).to(torch.bfloat16)
    return p16, c16, m, v, vmax
)PY";

// Params p{i} (bf16), grads g{i}_{s}, config [lr, b1, b2, eps, wd, dec, maximize, amsgrad]; outputs
// p/c/m/v{i}_{s}.
std::string reference_run(size_t n_params, int steps) {
  return std::string(kReference) + R"PY(
lr, b1, b2, eps, wd, dec, mx, ams = inputs['config'].tolist()
for i in range()PY" +
         std::to_string(n_params) + R"PY():
    p = inputs[f'p{i}']
    c = torch.zeros_like(p)
    m = torch.zeros(p.shape, dtype=t32); v = torch.zeros(p.shape, dtype=t32); vmax = torch.zeros(p.shape, dtype=t32)
    for s in range()PY" +
         std::to_string(steps) + R"PY():
        p, c, m, v, vmax = kahan_adam(p, c, inputs[f'g{i}_{s}'], m, v, vmax, s + 1, lr, b1, b2, eps, wd,
                                      bool(dec), bool(mx), bool(ams))
        outputs[f'p{i}_{s}'] = p; outputs[f'c{i}_{s}'] = c; outputs[f'm{i}_{s}'] = m; outputs[f'v{i}_{s}'] = v
)PY";
}

std::string key(const char* prefix, size_t i, int s) {
  return std::string(prefix) + std::to_string(i) + "_" + std::to_string(s);
}

struct Config {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled, maximize, amsgrad;
};

// Adam with L2; AdamW with amsgrad; beta1 = 0.4 (lerp weight >= 0.5, ATen's other branch) with
// maximize; each with lr large enough that some updates cross bf16 ulps and gradients of mixed
// magnitude so that others do not.
const Config kConfigs[] = {{1e-2, 0.9, 0.999, 1e-8, 0.01, false, false, false},
                           {3e-3, 0.9, 0.95, 1e-8, 0.1, true, false, true},
                           {1e-3, 0.4, 0.99, 1e-6, 0.0, false, true, false}};

AdamOptions options_of(const Config& c) {
  return AdamOptions(c.lr)
      .betas({c.beta1, c.beta2})
      .eps(c.eps)
      .weight_decay(c.weight_decay)
      .decoupled_weight_decay(c.decoupled)
      .maximize(c.maximize)
      .amsgrad(c.amsgrad);
}

// 37 (vector tails), 1000, and 300 x 129 = 38700 (two threads' worth; bf16 gradients).
const std::vector<std::vector<int64_t>> kShapes = {{37}, {1000}, {300, 129}};
constexpr size_t kBf16GradParam = 2;
constexpr int kSteps = 6;

TEST(AdamKahanTest, MatchesPythonReferenceBitwise_EveryOptionIsaAndThreadCount) {
  ROUNDPIPE_REQUIRE_ORACLE();
  torch::manual_seed(17);
  std::vector<torch::Tensor> init;
  TensorMap inputs;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    init.push_back(torch::randn(kShapes[i]).to(torch::kBFloat16));
    inputs["p" + std::to_string(i)] = init.back();
    for (int s = 0; s < kSteps; ++s) {
      auto g = torch::randn(kShapes[i]) * torch::exp(torch::randn(kShapes[i]) * 2);
      inputs[key("g", i, s)] = i == kBf16GradParam ? g.to(torch::kBFloat16) : g;
    }
  }
  const auto isas = supported_cpu_isas();
  for (const auto& c : kConfigs) {
    inputs["config"] = torch::tensor(
        {c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, double(c.decoupled), double(c.maximize), double(c.amsgrad)},
        torch::kDouble);
    const TensorMap ref = roundpipe::testing::run_python(reference_run(kShapes.size(), kSteps), inputs);
    for (const auto& isa : isas) {
      for (int threads : {1, 2}) {
        std::vector<torch::Tensor> params;
        for (const auto& t : init) {
          params.push_back(t.clone());
        }
        Adam opt(params, options_of(c).kahan_sum(true));
        opt.set_kernel_isa(isa);
        opt.set_num_threads(threads);
        const std::string what = "lr " + std::to_string(c.lr) + ", decoupled " + std::to_string(c.decoupled) +
                                 ", isa " + cpu_isa_name(isa) + ", threads " + std::to_string(threads);
        for (int s = 0; s < kSteps; ++s) {
          for (size_t i = 0; i < params.size(); ++i) {
            params[i].mutable_grad() = inputs.at(key("g", i, s));
          }
          opt.step();
          for (size_t i = 0; i < params.size(); ++i) {
            const auto& st = static_cast<const AdamParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
            const auto where = what + ", step " + std::to_string(s) + ", param " + std::to_string(i);
            ASSERT_EQ(params[i].scalar_type(), torch::kBFloat16) << where;
            ASSERT_EQ(st.kahan_compensation().scalar_type(), torch::kBFloat16) << where;
            ASSERT_EQ(st.exp_avg().scalar_type(), torch::kFloat) << where;
            ASSERT_TRUE(torch::equal(params[i], ref.at(key("p", i, s)))) << where << ": parameter";
            ASSERT_TRUE(torch::equal(st.kahan_compensation(), ref.at(key("c", i, s)))) << where << ": compensation";
            ASSERT_TRUE(torch::equal(st.exp_avg(), ref.at(key("m", i, s)))) << where << ": exp_avg";
            ASSERT_TRUE(torch::equal(st.exp_avg_sq(), ref.at(key("v", i, s)))) << where << ": exp_avg_sq";
          }
        }
        EXPECT_GT((params[1].to(torch::kFloat) - init[1].to(torch::kFloat)).abs().max().item<float>(), 3e-3)
            << what << ": parameters did not move";
        const auto& st = static_cast<const AdamParamState&>(*opt.state().at(params[1].unsafeGetTensorImpl()));
        EXPECT_GT(st.kahan_compensation().to(torch::kFloat).abs().max().item<float>(), 0.0f)
            << what << ": the compensation stayed zero";
      }
    }
  }
}

// Plain bf16 masters (no kahan_sum; Note [Kahan-compensated bf16 masters], last paragraph): each
// step is the float32 step of the widened weights rounded to bf16 once. Reference: the same Adam
// on float32 copies (== torch.optim.Adam/AdamW, adam_test.cpp) that are rounded to bf16 and
// widened back after every step; weights and moments bitwise, float32 and 8-bit moments, every
// option set, ISA and thread count. 5000 elements (a partial 8-bit block) beside the shapes above.
TEST(AdamKahanTest, PlainBf16_IsTheFloat32StepRoundedOnce_EveryOptionIsaStateDtypeAndThreadCount) {
  std::vector<std::vector<int64_t>> shapes = kShapes;
  shapes.push_back({5000});
  torch::manual_seed(29);
  std::vector<torch::Tensor> init;
  std::vector<std::vector<torch::Tensor>> grads(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    init.push_back(torch::randn(shapes[i]).to(torch::kBFloat16));
    for (int s = 0; s < kSteps; ++s) {
      auto g = torch::randn(shapes[i]) * torch::exp(torch::randn(shapes[i]) * 2);
      grads[i].push_back(i == kBf16GradParam ? g.to(torch::kBFloat16) : g);
    }
  }
  for (const auto& c : kConfigs) {
    for (const AdamStateDtype state_dtype : {AdamStateDtype::kFloat32, AdamStateDtype::kInt8}) {
      if (state_dtype == AdamStateDtype::kInt8 && c.amsgrad) continue;  // 8-bit states have no amsgrad
      const auto options = options_of(c).state_dtype(state_dtype);
      for (const auto& isa : supported_cpu_isas()) {
        for (int threads : {1, 2}) {
          std::vector<torch::Tensor> params, widened;
          for (const auto& t : init) {
            params.push_back(t.clone());
            widened.push_back(t.to(torch::kFloat));
          }
          Adam opt(params, options);
          Adam ref(widened, options);
          for (Adam* o : {&opt, &ref}) {
            o->set_kernel_isa(isa);
            o->set_num_threads(threads);
          }
          const std::string what = "lr " + std::to_string(c.lr) + ", int8 " +
                                   std::to_string(state_dtype == AdamStateDtype::kInt8) + ", isa " + cpu_isa_name(isa) +
                                   ", threads " + std::to_string(threads);
          for (int s = 0; s < kSteps; ++s) {
            for (size_t i = 0; i < params.size(); ++i) {
              params[i].mutable_grad() = grads[i][s];
              widened[i].mutable_grad() = grads[i][s];
            }
            opt.step();
            ref.step();
            for (size_t i = 0; i < params.size(); ++i) {
              torch::NoGradGuard no_grad;
              widened[i].copy_(widened[i].to(torch::kBFloat16));  // the reference's bf16 master
              const auto where = what + ", step " + std::to_string(s) + ", param " + std::to_string(i);
              const auto& st = static_cast<const AdamParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
              const auto& rst = static_cast<const AdamParamState&>(*ref.state().at(widened[i].unsafeGetTensorImpl()));
              ASSERT_EQ(params[i].scalar_type(), torch::kBFloat16) << where;
              ASSERT_FALSE(st.kahan_compensation().defined()) << where;
              ASSERT_TRUE(torch::equal(params[i], widened[i].to(torch::kBFloat16))) << where << ": parameter";
              ASSERT_TRUE(torch::equal(st.exp_avg(), rst.exp_avg())) << where << ": exp_avg";
              ASSERT_TRUE(torch::equal(st.exp_avg_sq(), rst.exp_avg_sq())) << where << ": exp_avg_sq";
              if (state_dtype == AdamStateDtype::kInt8 && params[i].numel() >= kMin8bitNumel) {
                ASSERT_EQ(st.exp_avg().scalar_type(), torch::kUInt8) << where;
                ASSERT_TRUE(torch::equal(st.exp_avg_absmax(), rst.exp_avg_absmax())) << where << ": absmax";
                ASSERT_TRUE(torch::equal(st.exp_avg_sq_absmax(), rst.exp_avg_sq_absmax())) << where << ": absmax";
              }
            }
          }
          EXPECT_GT((params[1].to(torch::kFloat) - init[1].to(torch::kFloat)).abs().max().item<float>(), 3e-3)
              << what << ": parameters did not move";
        }
      }
    }
  }
}

// With 8-bit moments: the int8 test's numpy reference of the block-wise quantization
// (tests/optim/adam_int8_reference.h) around the same Kahan update; 38700 elements (two threads'
// worth, bf16 gradients) and 5000 (a partial last block). Parameters, compensations, codes and
// scales bitwise.
TEST(AdamKahanTest, Int8Moments_MatchPythonReferenceBitwise_EveryIsaAndThreadCount) {
  ROUNDPIPE_REQUIRE_ORACLE();
  const std::vector<std::vector<int64_t>> shapes = {{300, 129}, {5000}};
  const Config configs[] = {{3e-3, 0.9, 0.95, 1e-8, 0.1, true, false, false},
                            {1e-2, 0.4, 0.999, 1e-6, 0.01, false, true, false}};
  torch::manual_seed(19);
  std::vector<torch::Tensor> init;
  TensorMap inputs;
  for (size_t i = 0; i < shapes.size(); ++i) {
    init.push_back(torch::randn(shapes[i]).to(torch::kBFloat16));
    inputs["p" + std::to_string(i)] = init.back();
    for (int s = 0; s < kSteps; ++s) {
      auto g = torch::randn(shapes[i]) * torch::exp(torch::randn(shapes[i]) * 2);
      inputs[key("g", i, s)] = i == 0 ? g.to(torch::kBFloat16) : g;
    }
  }
  const std::string snippet = std::string(test_reference::kAdamInt8Reference) + kReference + R"PY(
lr, b1, b2, eps, wd, dec, mx, ams = inputs['config'].tolist()
for i in range()PY" + std::to_string(shapes.size()) +
                              R"PY():
    p = inputs[f'p{i}'].flatten()
    c = torch.zeros_like(p)
    c1, a1 = quant(np.zeros(p.numel(), np.float32), True); c2, a2 = quant(np.zeros(p.numel(), np.float32), False)
    for s in range()PY" + std::to_string(kSteps) +
                              R"PY():
        m = torch.from_numpy(dequant(c1, a1, True).astype(np.float32))
        v = torch.from_numpy(dequant(c2, a2, False).astype(np.float32))
        p, c, m, v, _ = kahan_adam(p, c, inputs[f'g{i}_{s}'].flatten(), m, v, v, s + 1, lr, b1, b2, eps, wd,
                                   bool(dec), bool(mx), False)
        c1, a1 = quant(m.numpy(), True); c2, a2 = quant(v.numpy(), False)
        outputs[f'p{i}_{s}'] = p; outputs[f'c{i}_{s}'] = c
        outputs[f'c1{i}_{s}'] = torch.from_numpy(c1.copy()); outputs[f'a1{i}_{s}'] = torch.from_numpy(a1.copy())
        outputs[f'c2{i}_{s}'] = torch.from_numpy(c2.copy()); outputs[f'a2{i}_{s}'] = torch.from_numpy(a2.copy())
)PY";
  for (const auto& c : kConfigs) {
    inputs["config"] = torch::tensor(
        {c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, double(c.decoupled), double(c.maximize), double(c.amsgrad)},
        torch::kDouble);
    const TensorMap ref = roundpipe::testing::run_python(snippet, inputs);
    for (const auto& isa : supported_cpu_isas()) {
      for (int threads : {1, 2}) {
        std::vector<torch::Tensor> params;
        for (const auto& t : init) {
          params.push_back(t.clone());
        }
        Adam opt(params, AdamOptions(c.lr)
                             .betas({c.beta1, c.beta2})
                             .eps(c.eps)
                             .weight_decay(c.weight_decay)
                             .decoupled_weight_decay(c.decoupled)
                             .maximize(c.maximize)
                             .state_dtype(AdamStateDtype::kInt8)
                             .kahan_sum(true));
        opt.set_kernel_isa(isa);
        opt.set_num_threads(threads);
        const std::string what =
            "lr " + std::to_string(c.lr) + ", isa " + cpu_isa_name(isa) + ", threads " + std::to_string(threads);
        for (int s = 0; s < kSteps; ++s) {
          for (size_t i = 0; i < params.size(); ++i) {
            params[i].mutable_grad() = inputs.at(key("g", i, s));
          }
          opt.step();
          for (size_t i = 0; i < params.size(); ++i) {
            const auto& st = static_cast<const AdamParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
            const auto where = what + ", step " + std::to_string(s) + ", param " + std::to_string(i);
            ASSERT_EQ(st.exp_avg().scalar_type(), torch::kByte) << where;
            ASSERT_TRUE(torch::equal(params[i].flatten(), ref.at(key("p", i, s)))) << where << ": parameter";
            ASSERT_TRUE(torch::equal(st.kahan_compensation().flatten(), ref.at(key("c", i, s))))
                << where << ": compensation";
            ASSERT_TRUE(torch::equal(st.exp_avg().flatten(), ref.at(key("c1", i, s)))) << where << ": exp_avg codes";
            ASSERT_TRUE(torch::equal(st.exp_avg_sq().flatten(), ref.at(key("c2", i, s))))
                << where << ": exp_avg_sq codes";
            ASSERT_TRUE(torch::equal(st.exp_avg_absmax(), ref.at(key("a1", i, s)))) << where;
            ASSERT_TRUE(torch::equal(st.exp_avg_sq_absmax(), ref.at(key("a2", i, s)))) << where;
          }
        }
      }
    }
  }
}

// 2000 AdamW steps of lr 2e-5 on 4096 weights of magnitude ~1 (updates ~2e-5, far below half a
// bf16 ulp, 2^-9 or 2^-8 there) with a steady gradient direction plus noise: the float32-master
// run moves ~0.04. Plain bf16 rounding (the same Adam on float32, the weight rounded to bf16 after
// every step) cancels every update and stays put; the Kahan master follows the float32 run to
// within an ulp on average. A quality check of Note [Kahan-compensated bf16 masters], not a timing.
TEST(AdamKahanTest, TinyUpdates_KahanTracksFloat32MasterWherePlainBf16Stalls) {
  torch::manual_seed(23);
  constexpr int64_t kNumel = 4096;
  constexpr int kStepCount = 2000;
  const auto p0 = (torch::randn({kNumel}) + 1).to(torch::kBFloat16).to(torch::kFloat);
  const auto direction = torch::randn({kNumel}).sign();
  const auto options = AdamOptions(2e-5).weight_decay(0.01).decoupled_weight_decay(true);
  auto fp32 = p0.clone(), plain = p0.clone(), kahan = p0.to(torch::kBFloat16), plain16 = p0.to(torch::kBFloat16);
  Adam fp32_opt({fp32}, options);
  Adam plain_opt({plain}, options);
  Adam kahan_opt({kahan}, AdamOptions(options).kahan_sum(true));
  Adam plain16_opt({plain16}, options);  // a bf16 master without kahan_sum
  for (int s = 0; s < kStepCount; ++s) {
    const auto g = direction + 0.5 * torch::randn({kNumel});
    fp32.mutable_grad() = g;
    plain.mutable_grad() = g;
    kahan.mutable_grad() = g;
    plain16.mutable_grad() = g;
    fp32_opt.step();
    plain_opt.step();
    plain.copy_(plain.to(torch::kBFloat16));
    kahan_opt.step();
    plain16_opt.step();
  }
  EXPECT_TRUE(torch::equal(plain16.to(torch::kFloat), plain)) << "plain bf16 master != float32 step rounded";
  const double moved = (fp32 - p0).abs().mean().item<double>();
  const double plain_err = (plain - fp32).abs().mean().item<double>();
  const double kahan_err = (kahan.to(torch::kFloat) - fp32).abs().mean().item<double>();
  // Errors in bf16 ulps of each fp32 weight (2^(exponent - 7)), averaged.
  const auto ulp = torch::pow(2.0, torch::floor(torch::log2(fp32.abs().clamp_min(1e-6))) - 7);
  const double kahan_ulps = ((kahan.to(torch::kFloat) - fp32).abs() / ulp).mean().item<double>();
  const double plain_ulps = ((plain - fp32).abs() / ulp).mean().item<double>();
  std::cout << "[ kahan ] fp32 master moved " << moved << " on average; mean |error| plain bf16 " << plain_err
            << ", Kahan " << kahan_err << "; mean error in bf16 ulps plain " << plain_ulps << ", Kahan " << kahan_ulps
            << "\n";
  EXPECT_GT(moved, 0.02);
  // Kahan stays within about an ulp (the bf16 compensation's own rounding drifts a little; a
  // float32 simulation of the formula gives the same 0.6 ulps); plain rounding loses the whole move.
  EXPECT_LT(kahan_err, 0.2 * moved);
  EXPECT_LT(kahan_ulps, 1.0);
  EXPECT_GT(plain_err, 0.5 * moved) << "plain bf16 rounding should lose the tiny updates";
  EXPECT_GT(plain_ulps, 2.0);
}

std::string saved(const Adam& opt) {
  std::stringstream buffer;
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  archive.save_to(buffer);
  return buffer.str();
}

void load_into(Adam& opt, const std::string& bytes) {
  std::stringstream buffer(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(buffer);
  opt.load(archive);
}

// Group 0: bf16 masters with Kahan (a 5000-element one with 8-bit moments, a 300-element one under
// the 8-bit threshold) and a float32 parameter in the same group; group 1: plain float32 Adam.
struct KahanRun {
  std::vector<torch::Tensor> a, b, grads;
  static constexpr int kTotal = 8;

  explicit KahanRun(uint64_t seed) {
    torch::manual_seed(seed);
    a = {torch::randn({50, 100}).to(torch::kBFloat16), torch::randn({300}).to(torch::kBFloat16), torch::randn({20})};
    b = {torch::randn({33})};
    for (int s = 0; s < kTotal; ++s) {
      for (const auto& p : all()) {
        grads.push_back(torch::randn(p.sizes()) * 1e-2);
      }
    }
  }
  std::vector<torch::Tensor> all() const { return {a[0], a[1], a[2], b[0]}; }
  std::unique_ptr<Adam> make() const {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(a, std::make_unique<AdamOptions>(AdamOptions(1e-3)
                                                             .weight_decay(0.1)
                                                             .decoupled_weight_decay(true)
                                                             .state_dtype(AdamStateDtype::kInt8)
                                                             .kahan_sum(true)));
    groups.emplace_back(b);
    return std::make_unique<Adam>(groups, AdamOptions(3e-3));
  }
  void run(Adam& opt, int from, int to) {
    const auto params = all();
    for (int s = from; s < to; ++s) {
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() = grads[s * params.size() + i];
      }
      opt.step();
    }
  }
};

TEST(AdamKahanTest, StateDictRoundTrip_ResumesBitwise) {
  KahanRun straight(31), resumed(31);
  auto opt = straight.make();
  straight.run(*opt, 0, KahanRun::kTotal);

  auto first = resumed.make();
  resumed.run(*first, 0, 3);
  const std::string bytes = saved(*first);
  for (auto* list : {&resumed.a, &resumed.b}) {
    for (auto& p : *list) {
      p = p.detach().clone();
    }
  }
  auto second = resumed.make();
  load_into(*second, bytes);
  ASSERT_EQ(second->state().size(), 4u);
  const auto& loaded = static_cast<const AdamParamState&>(*second->state().at(resumed.a[0].unsafeGetTensorImpl()));
  EXPECT_EQ(loaded.kahan_compensation().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(loaded.exp_avg().scalar_type(), torch::kByte);
  EXPECT_GT(loaded.kahan_compensation().to(torch::kFloat).abs().max().item<float>(), 0.0f);
  EXPECT_FALSE(static_cast<const AdamParamState&>(*second->state().at(resumed.a[2].unsafeGetTensorImpl()))
                   .kahan_compensation()
                   .defined())
      << "float32 parameters of a kahan_sum group have no compensation";
  EXPECT_TRUE(static_cast<const AdamOptions&>(second->param_groups()[0].options()).kahan_sum());
  EXPECT_FALSE(static_cast<const AdamOptions&>(second->param_groups()[1].options()).kahan_sum());
  resumed.run(*second, 3, KahanRun::kTotal);
  const auto x = straight.all(), y = resumed.all();
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TENSOR_EQ(y[i], x[i]) << "param " << i;
    const auto& s1 = static_cast<const AdamParamState&>(*opt->state().at(x[i].unsafeGetTensorImpl()));
    const auto& s2 = static_cast<const AdamParamState&>(*second->state().at(y[i].unsafeGetTensorImpl()));
    EXPECT_TRUE(s1 == s2) << "param " << i;
  }
}

template <typename Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(AdamKahanTest, BadInput_ClearErrors) {
  const auto bf16 = torch::zeros({3}, torch::kBFloat16);
  EXPECT_NO_THROW(Adam({bf16}));  // plain bf16 masters
  {                               // a compensation in a group without kahan_sum (a state dict of another optimizer)
    auto plain = torch::zeros({3}, torch::kBFloat16);
    Adam opt({plain});
    plain.mutable_grad() = torch::ones({3});
    opt.step();
    static_cast<AdamParamState&>(*opt.state().at(plain.unsafeGetTensorImpl()))
        .kahan_compensation(torch::zeros({3}, torch::kBFloat16));
    expect_error([&] { opt.step(); },
                 "a BFloat16 parameter of shape [3] in a group without kahan_sum has a state 'kahan_compensation'");
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{torch::zeros({2})});
  groups.emplace_back(std::vector<torch::Tensor>{bf16}, std::make_unique<AdamOptions>(AdamOptions().kahan_sum(true)));
  EXPECT_NO_THROW(Adam opt(groups));
  expect_error([&] { Adam({torch::zeros({3}, torch::kHalf)}, AdamOptions().kahan_sum(true)); }, "dense float32 CPU");
  expect_error(
      [&] {
        Adam({torch::zeros({4, 4}, torch::kBFloat16).t()}, AdamOptions().kahan_sum(true));
      },
      "bfloat16 parameter of shape [4, 4] is not contiguous");

  auto p = torch::zeros({3}, torch::kBFloat16);
  Adam opt({p}, AdamOptions().kahan_sum(true));
  expect_error([&] { opt.set_compute_copy(p, torch::zeros({3}, torch::kBFloat16)); }, "which is its own compute copy");
  EXPECT_NO_THROW(opt.set_compute_copy(p, torch::Tensor()));
  p.mutable_grad() = torch::ones({3});
  opt.step();
  // A state whose compensation went missing (a state dict of another optimizer).
  auto& state = static_cast<AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
  state.kahan_compensation(torch::Tensor());
  expect_error([&] { opt.step(); }, "state 'kahan_compensation' is missing for a bfloat16 parameter of shape [3]");
  state.kahan_compensation(torch::zeros({3}));
  expect_error([&] { opt.step(); }, "needs bfloat16 of its shape");

  // Archives: kahan_sum must match (float32 parameters, which both settings accept).
  auto q = torch::zeros({3});
  q.mutable_grad() = torch::ones({3});
  Adam with({q}, AdamOptions().kahan_sum(true));
  with.step();
  Adam without({q});
  without.step();
  const std::string with_bytes = saved(with), without_bytes = saved(without);
  Adam fresh_without({q});
  expect_error([&] { load_into(fresh_without, with_bytes); },
               "has kahan_sum true but this optimizer's group 0 has kahan_sum false; construct the optimizer with "
               "AdamOptions().kahan_sum(true)");
  EXPECT_TRUE(fresh_without.state().empty());
  Adam fresh_with({q}, AdamOptions().kahan_sum(true));
  expect_error([&] { load_into(fresh_with, without_bytes); }, "AdamOptions().kahan_sum(false)");
  EXPECT_TRUE(static_cast<const AdamOptions&>(fresh_with.param_groups()[0].options()).kahan_sum());
}

}  // namespace
}  // namespace roundpipe::optim
