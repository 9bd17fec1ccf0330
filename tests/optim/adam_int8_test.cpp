// roundpipe::optim::Adam with 8-bit states (AdamStateDtype::kInt8) against a Python reference of
// the same block-wise quantization (numpy, written from bitsandbytes' description, not from our
// C++), resume through state dicts, a training sanity check against fp32 Adam, and bad input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "optim/adam.h"
#include "optim/detail/adam_kernel.h"
#include "optim/quantized_state.h"
#include "tests/common/python_oracle.h"
#include "tests/common/sanitizer_memory.h"
#include "tests/common/tensor_compare.h"
#include "tests/optim/adam_int8_reference.h"

namespace roundpipe::optim {
namespace {

using roundpipe::testing::max_abs_diff;
using roundpipe::testing::TensorMap;

// The reference: tests/optim/adam_int8_reference.h.
constexpr const char* kReference = test_reference::kAdamInt8Reference;

// Runs the reference: params p{i}, grads g{i}_{s} from `inputs`, config row [lr, b1, b2, eps, wd,
// decoupled, maximize]; outputs p{i}_{s}, and for 8-bit params c1/a1/c2/a2{i}_{s} (codes, absmax).
std::string reference_run(int n_params, int steps) {
  return std::string(kReference) + R"PY(
lr, b1, b2, eps, wd, dec, mx = inputs['config'].tolist()
for i in range()PY" +
         std::to_string(n_params) + R"PY():
    p = inputs[f'p{i}'].numpy().astype(np.float32).ravel()
    n = p.size
    q = n >= 4096
    m = np.zeros(n, np.float32); v = np.zeros(n, np.float32)
    c1, a1 = quant(m, True); c2, a2 = quant(v, False)
    for s in range()PY" +
         std::to_string(steps) + R"PY():
        g = inputs[f'g{i}_{s}'].float().numpy().ravel()
        if q:
            m = dequant(c1, a1, True); v = dequant(c2, a2, False)
        p, m, v = adam_math(p, g, m, v, s + 1, lr, b1, b2, eps, wd, bool(dec), bool(mx))
        outputs[f'p{i}_{s}'] = torch.from_numpy(p.copy())
        if q:
            c1, a1 = quant(m, True); c2, a2 = quant(v, False)
            outputs[f'c1{i}_{s}'] = torch.from_numpy(c1.copy()); outputs[f'a1{i}_{s}'] = torch.from_numpy(a1.copy())
            outputs[f'c2{i}_{s}'] = torch.from_numpy(c2.copy()); outputs[f'a2{i}_{s}'] = torch.from_numpy(a2.copy())
        else:
            outputs[f'm{i}_{s}'] = torch.from_numpy(m.copy()); outputs[f'v{i}_{s}'] = torch.from_numpy(v.copy())
)PY";
}

struct Config {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled, maximize;
};

std::string key(const char* prefix, size_t i, int s) {
  return std::string(prefix) + std::to_string(i) + "_" + std::to_string(s);
}

// 1000: under kMin8bitNumel (float32 states); 4096: exactly the threshold, 16 whole blocks;
// 5000 and 70 x 129 = 9030: last block partial; the 9030 one gets bf16 gradients.
const std::vector<std::vector<int64_t>> kShapes = {{1000}, {4096}, {5000}, {70, 129}};
constexpr size_t kBf16GradParam = 3;
constexpr int kSteps = 6;

// A kernel to test: an ISA, and for AVX-512 whether it may use its VBMI dequantize (Note [Byte-plane
// dequantize] in optim/detail/adam_kernel_avx512.cpp).
struct Kernel {
  CpuIsa isa;
  bool vbmi;
  std::string name() const {
    return std::string(cpu_isa_name(isa)) + (isa == CpuIsa::kAvx512 && !vbmi ? " without VBMI" : "");
  }
};

// Every supported ISA, and AVX-512 a second time without VBMI where the CPU has VBMI.
std::vector<Kernel> kernels() {
  std::vector<Kernel> out;
  for (const CpuIsa isa : supported_cpu_isas()) {
    out.push_back({isa, true});
    if (isa == CpuIsa::kAvx512 && detail::cpu_has_avx512_vbmi()) {
      out.push_back({isa, false});
    }
  }
  return out;
}

// Allows or forbids the VBMI dequantize while in scope.
class VbmiScope {
 public:
  explicit VbmiScope(bool allowed) { detail::set_avx512_vbmi_allowed(allowed); }
  ~VbmiScope() { detail::set_avx512_vbmi_allowed(true); }
  VbmiScope(const VbmiScope&) = delete;
  VbmiScope& operator=(const VbmiScope&) = delete;
};

TEST(AdamInt8Test, MatchesPythonReferenceOfTheSameQuantization_AdamAndAdamW_EveryIsaAndThreadCount) {
  ROUNDPIPE_REQUIRE_ORACLE();
  // Adam with L2, AdamW, and beta1 = 0.4 (lerp weight >= 0.5, ATen's other branch) with maximize.
  const Config configs[] = {{1e-2, 0.9, 0.999, 1e-8, 0.01, false, false},
                            {3e-3, 0.9, 0.95, 1e-8, 0.1, true, false},
                            {1e-3, 0.4, 0.99, 1e-6, 0.0, false, true}};
  torch::manual_seed(11);
  std::vector<torch::Tensor> init;
  TensorMap inputs;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    init.push_back(torch::randn(kShapes[i]));
    inputs["p" + std::to_string(i)] = init.back();
    for (int s = 0; s < kSteps; ++s) {
      // Magnitudes over several decades so that many map entries are used.
      auto g = torch::randn(kShapes[i]) * torch::exp(torch::randn(kShapes[i]) * 2);
      inputs[key("g", i, s)] = i == kBf16GradParam ? g.to(torch::kBFloat16) : g;
    }
  }
  for (const auto& c : configs) {
    inputs["config"] = torch::tensor(
        {c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, double(c.decoupled), double(c.maximize)}, torch::kDouble);
    const TensorMap ref = roundpipe::testing::run_python(reference_run(kShapes.size(), kSteps), inputs);
    for (const auto& kernel : kernels()) {
      const CpuIsa isa = kernel.isa;
      const VbmiScope vbmi(kernel.vbmi);
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
                             .state_dtype(AdamStateDtype::kInt8));
        opt.set_kernel_isa(isa);
        opt.set_num_threads(threads);
        const std::string what = "lr " + std::to_string(c.lr) + ", decoupled " + std::to_string(c.decoupled) +
                                 ", isa " + kernel.name() + ", threads " + std::to_string(threads);
        bool bitwise = true;
        for (int s = 0; s < kSteps; ++s) {
          for (size_t i = 0; i < params.size(); ++i) {
            params[i].mutable_grad() = inputs.at(key("g", i, s));
          }
          opt.step();
          for (size_t i = 0; i < params.size(); ++i) {
            const auto& st = static_cast<const AdamParamState&>(*opt.state().at(params[i].unsafeGetTensorImpl()));
            const auto where = what + ", step " + std::to_string(s) + ", param " + std::to_string(i);
            const auto p_ref = ref.at(key("p", i, s)).view(params[i].sizes());
            ASSERT_LE(max_abs_diff(params[i], p_ref), 1e-6) << where;
            bitwise = bitwise && torch::equal(params[i], p_ref);
            if (params[i].numel() < kMin8bitNumel) {
              ASSERT_EQ(st.exp_avg().scalar_type(), torch::kFloat) << where;
              ASSERT_FALSE(st.exp_avg_absmax().defined()) << where;
              ASSERT_LE(max_abs_diff(st.exp_avg().flatten(), ref.at(key("m", i, s))), 1e-6) << where;
              ASSERT_LE(max_abs_diff(st.exp_avg_sq().flatten(), ref.at(key("v", i, s))), 1e-6) << where;
              continue;
            }
            ASSERT_EQ(st.exp_avg().scalar_type(), torch::kByte) << where;
            ASSERT_EQ(st.exp_avg().sizes(), params[i].sizes()) << where;
            const auto c1 = ref.at(key("c1", i, s)), c2 = ref.at(key("c2", i, s));
            const auto a1 = ref.at(key("a1", i, s)), a2 = ref.at(key("a2", i, s));
            // Codes and scales: bitwise (they are what a checkpoint stores).
            ASSERT_EQ((st.exp_avg().flatten() != c1).sum().item<int64_t>(), 0) << where << ": exp_avg codes";
            ASSERT_EQ((st.exp_avg_sq().flatten() != c2).sum().item<int64_t>(), 0) << where << ": exp_avg_sq codes";
            ASSERT_TRUE(torch::equal(st.exp_avg_absmax(), a1)) << where;
            ASSERT_TRUE(torch::equal(st.exp_avg_sq_absmax(), a2)) << where;
            const auto m = dequantize_blockwise(st.exp_avg(), st.exp_avg_absmax(), QuantMap::kSignedDynamic);
            const auto m_ref = dequantize_blockwise(c1.view(params[i].sizes()), a1, QuantMap::kSignedDynamic);
            ASSERT_LE(max_abs_diff(m, m_ref), 1e-6) << where;
          }
        }
        EXPECT_TRUE(bitwise) << what << ": within 1e-6 but not bitwise equal to the reference";
        EXPECT_GT(max_abs_diff(params[2], init[2]), 1e-3) << what << ": parameters did not move";
      }
    }
  }
}

// Map values, the midpoints between them, and the floats next to both (positive and negative), in
// blocks that each start with 1.0 (absmax 1).
torch::Tensor edges(QuantMap map) {
  const auto v = dynamic_quant_map(map);
  const auto mid = (v.slice(0, 0, 255) + v.slice(0, 1, 256)) * 0.5f;
  const auto inf = torch::full({1}, std::numeric_limits<float>::infinity());
  auto all = torch::cat({v, mid});
  all = torch::cat({all, torch::nextafter(all, inf), torch::nextafter(all, -inf)});
  // Relative distances 2^-23..2^-8 from each midpoint, both sides: across the edges of the band
  // around a threshold where the AVX-512 kernel falls back to its gather (Note [Decade code lookup]).
  for (int k = 8; k <= 23; ++k) {
    all = torch::cat({all, mid * (1.0f + std::ldexp(1.0f, -k)), mid * (1.0f - std::ldexp(1.0f, -k))});
  }
  all = torch::cat({all, -all}).clamp(-1, 1);
  const int64_t blocks = (all.numel() + kQuantBlockSize - 2) / (kQuantBlockSize - 1);
  const auto padded = torch::cat({all, torch::zeros({blocks * (kQuantBlockSize - 1) - all.numel()})});
  return torch::cat({torch::ones({blocks, 1}), padded.view({blocks, kQuantBlockSize - 1})}, 1).reshape({-1});
}

TEST(AdamInt8Test, DynamicMapsEqualTheReferenceAndBitsandbytesFormula_QuantizeRoundTrips) {
  ROUNDPIPE_REQUIRE_ORACLE();
  torch::manual_seed(5);
  auto x = torch::randn({1000}) * torch::exp(torch::randn({1000}) * 3);
  x.slice(0, 256, 512).zero_();  // an all-zero block: absmax 0, every code that of 0
  const auto ref = roundpipe::testing::run_python(
      std::string(kReference) + R"PY(
for name, signed in (('signed', True), ('unsigned', False)):
    outputs[name] = torch.from_numpy(MAPS[signed][0].copy())
    outputs['bnb_' + name] = bnb_map(signed)
x = inputs['x'].numpy()
codes, absmax = quant(x, True)
outputs['codes'] = torch.from_numpy(codes); outputs['absmax'] = torch.from_numpy(absmax)
for signed in (True, False):
    e = inputs['edges_' + str(signed)].numpy()
    outputs['edge_codes_' + str(signed)] = torch.from_numpy(quant(e, signed)[0])
)PY",
      {{"x", x}, {"edges_True", edges(QuantMap::kSignedDynamic)}, {"edges_False", edges(QuantMap::kUnsignedDynamic)}});
  const auto s = dynamic_quant_map(QuantMap::kSignedDynamic);
  const auto u = dynamic_quant_map(QuantMap::kUnsignedDynamic);
  EXPECT_TRUE(torch::equal(s, ref.at("signed")));
  EXPECT_TRUE(torch::equal(u, ref.at("unsigned")));
  // bitsandbytes builds the same map in float32: equal to a float32 rounding or two.
  EXPECT_LE(((s - ref.at("bnb_signed")).abs() / ref.at("bnb_signed").abs().clamp_min(1e-30)).max().item<double>(),
            1e-6);
  EXPECT_LE(((u - ref.at("bnb_unsigned")).abs() / ref.at("bnb_unsigned").abs().clamp_min(1e-30)).max().item<double>(),
            1e-6);
  EXPECT_EQ(s[127].item<float>(), 0.0f);
  EXPECT_EQ(s[255].item<float>(), 1.0f);
  EXPECT_EQ(u[0].item<float>(), 0.0f);
  EXPECT_EQ(u[255].item<float>(), 1.0f);
  EXPECT_TRUE(torch::equal(std::get<0>(torch::sort(s)), s));

  // Every map value, midpoint and their float neighbours (x / absmax exact: absmax 1): the code
  // lookup equals numpy's searchsorted at the boundaries.
  for (const auto map : {QuantMap::kSignedDynamic, QuantMap::kUnsignedDynamic}) {
    const auto e = edges(map);
    const std::string name = map == QuantMap::kSignedDynamic ? "edge_codes_True" : "edge_codes_False";
    EXPECT_GT(e.numel(), 3000);
    EXPECT_TRUE(torch::equal(quantize_blockwise(e, map).first, ref.at(name))) << name;
  }
  const auto [codes, absmax] = quantize_blockwise(x, QuantMap::kSignedDynamic);
  EXPECT_TRUE(torch::equal(codes, ref.at("codes")));
  EXPECT_TRUE(torch::equal(absmax, ref.at("absmax")));
  EXPECT_EQ(absmax[1].item<float>(), 0.0f);
  // Nearest value: the error is at most half the largest gap of the map (0.9 / 64 between the
  // top decade's values, or -1 to the smallest value -0.99297) times absmax.
  const auto back = dequantize_blockwise(codes, absmax, QuantMap::kSignedDynamic);
  const auto bound = torch::repeat_interleave(absmax, kQuantBlockSize).slice(0, 0, 1000) * 0.00704;
  EXPECT_TRUE(((back - x).abs() <= bound).all().item<bool>());
}

// Two groups: 8-bit AdamW (a 5000-element and a 300-element parameter, the latter under the
// threshold) and float32 Adam; fixed gradients.
struct Int8Run {
  std::vector<torch::Tensor> a, b, grads;
  static constexpr int kTotal = 8;

  explicit Int8Run(uint64_t seed) {
    torch::manual_seed(seed);
    a = {torch::randn({50, 100}), torch::randn({300})};
    b = {torch::randn({4100})};
    for (int s = 0; s < kTotal; ++s) {
      for (const auto& p : all()) {
        grads.push_back(torch::randn(p.sizes()));
      }
    }
  }
  std::vector<torch::Tensor> all() const { return {a[0], a[1], b[0]}; }
  std::unique_ptr<Adam> make() const {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(
        a, std::make_unique<AdamOptions>(
               AdamOptions(1e-2).weight_decay(0.1).decoupled_weight_decay(true).state_dtype(AdamStateDtype::kInt8)));
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

TEST(AdamInt8Test, StateDictRoundTrip_ResumesBitwise) {
  Int8Run straight(21), resumed(21);
  auto opt = straight.make();
  straight.run(*opt, 0, Int8Run::kTotal);

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
  ASSERT_EQ(second->state().size(), 3u);
  const auto& loaded = static_cast<const AdamParamState&>(*second->state().at(resumed.a[0].unsafeGetTensorImpl()));
  EXPECT_EQ(loaded.exp_avg().scalar_type(), torch::kByte);
  EXPECT_EQ(loaded.exp_avg_absmax().numel(), 20);  // ceil(5000 / 256)
  resumed.run(*second, 3, Int8Run::kTotal);
  const auto x = straight.all(), y = resumed.all();
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TENSOR_EQ(y[i], x[i]);
    const auto& s1 = static_cast<const AdamParamState&>(*opt->state().at(x[i].unsafeGetTensorImpl()));
    const auto& s2 = static_cast<const AdamParamState&>(*second->state().at(y[i].unsafeGetTensorImpl()));
    EXPECT_TRUE(s1 == s2) << "param " << i;
  }
  const auto& small = static_cast<const AdamParamState&>(*second->state().at(y[1].unsafeGetTensorImpl()));
  EXPECT_EQ(small.exp_avg().scalar_type(), torch::kFloat) << "300 elements: under kMin8bitNumel";
  EXPECT_EQ(static_cast<const AdamOptions&>(second->param_groups()[0].options()).state_dtype(), AdamStateDtype::kInt8);
  EXPECT_EQ(static_cast<const AdamOptions&>(second->param_groups()[1].options()).state_dtype(),
            AdamStateDtype::kFloat32);
}

// Least squares y = x W*^T on a 128 -> 64 linear layer (8192 weights: 8-bit states), 60 steps:
// 8-bit Adam ends near float32 Adam (loose: quantization noise, not a bitwise comparison).
TEST(AdamInt8Test, RegressionLoss_EndsCloseToFloat32Adam) {
  torch::manual_seed(4);
  const auto x = torch::randn({512, 128});
  const auto w_true = torch::randn({64, 128}) / 8;
  const auto y = torch::matmul(x, w_true.t()) + 0.01 * torch::randn({512, 64});
  const auto w0 = torch::zeros({64, 128});
  double initial = 0;
  auto train = [&](AdamStateDtype dtype) {
    auto w = w0.clone().requires_grad_(true);
    Adam opt({w}, AdamOptions(1e-2).state_dtype(dtype));
    double loss = 0;
    for (int s = 0; s < 60; ++s) {
      opt.zero_grad();
      auto l = (torch::matmul(x, w.t()) - y).pow(2).mean();
      l.backward();
      if (s == 0) {
        initial = l.item<double>();
      }
      opt.step();
      loss = l.item<double>();
    }
    return loss;
  };
  const double fp32 = train(AdamStateDtype::kFloat32);
  const double int8 = train(AdamStateDtype::kInt8);
  std::cout << "[ regression ] initial " << initial << ", fp32 Adam " << fp32 << ", 8-bit Adam " << int8 << "\n";
  EXPECT_LT(fp32, initial * 1e-2);
  EXPECT_LT(int8, initial * 1e-2);
  EXPECT_LT(int8, fp32 * 2 + initial * 1e-3);
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

TEST(AdamInt8Test, MismatchedStateDtype_ClearErrorAndOptimizerUnchanged) {
  auto p = torch::randn({5000});
  p.mutable_grad() = torch::randn({5000});
  Adam fp32({p}, AdamOptions(1e-3));
  fp32.step();
  Adam int8({p}, AdamOptions(1e-3).state_dtype(AdamStateDtype::kInt8));
  int8.step();
  const std::string fp32_bytes = saved(fp32), int8_bytes = saved(int8);

  Adam fresh_int8({p}, AdamOptions(1e-3).state_dtype(AdamStateDtype::kInt8));
  expect_error([&] { load_into(fresh_int8, fp32_bytes); },
               "has state_dtype float32 but this optimizer's group 0 has state_dtype int8; construct the optimizer "
               "with AdamOptions().state_dtype(AdamStateDtype::kFloat32)");
  EXPECT_TRUE(fresh_int8.state().empty());
  EXPECT_EQ(static_cast<const AdamOptions&>(fresh_int8.param_groups()[0].options()).state_dtype(),
            AdamStateDtype::kInt8);
  Adam fresh_fp32({p}, AdamOptions(1e-3));
  fresh_fp32.step();
  const auto before = static_cast<const AdamParamState&>(*fresh_fp32.state().begin()->second).exp_avg().clone();
  expect_error([&] { load_into(fresh_fp32, int8_bytes); }, "AdamStateDtype::kInt8) to resume from this archive");
  EXPECT_TENSOR_EQ(static_cast<const AdamParamState&>(*fresh_fp32.state().begin()->second).exp_avg(), before);

  // Changing a group's state_dtype under existing states.
  static_cast<AdamOptions&>(int8.param_groups()[0].options()).state_dtype(AdamStateDtype::kFloat32);
  expect_error([&] { int8.step(); }, "holds 8-bit moments but its param group has state_dtype float32");
  static_cast<AdamOptions&>(fp32.param_groups()[0].options()).state_dtype(AdamStateDtype::kInt8);
  expect_error([&] { fp32.step(); }, "holds float32 moments but its param group has state_dtype int8");

  expect_error([&] { Adam({p}, AdamOptions().amsgrad(true).state_dtype(AdamStateDtype::kInt8)); },
               "amsgrad is not supported with state_dtype int8");
  expect_error(
      [&] { dequantize_blockwise(torch::zeros({300}, torch::kByte), torch::zeros({1}), QuantMap::kSignedDynamic); },
      "absmax must be a float32 CPU tensor of 2 elements");
}

// Every ISA's kernel quantizes exactly as quantize_blockwise (the scalar reference of Note [Fine
// code lookup]) on hard inputs: with beta1 = 0 the new exp_avg is the gradient itself and with
// beta2 = 0 the new exp_avg_sq is g * g, so the kernel quantizes values we choose. Blocks that
// start with 1.0 (absmax 1) holding random float bit patterns of magnitude <= 1 (denormals and
// signed zeros included), the map values, midpoints and their neighbours, and blocks with NaNs
// and huge values (absmax 3e38: x / absmax underflows to denormals); the last block partial.
TEST(AdamInt8Test, EveryIsaQuantizesLikeTheScalarReference_RandomBitsAndEdges) {
  torch::manual_seed(11);
  const int64_t random_blocks = 600;
  auto bits = torch::randint(0, int64_t{1} << 31, {random_blocks, kQuantBlockSize - 1}, torch::kLong);
  // |x| bits in [0, bits of 1.0]; a set sign bit as the int32 of the same bits (mag - 2^31).
  bits = bits.remainder(int64_t{0x3F800001}) - torch::randint(0, 2, bits.sizes(), torch::kLong) * (int64_t{1} << 31);
  const auto random = bits.to(torch::kInt).view(torch::kFloat);
  auto g = torch::cat({torch::ones({random_blocks, 1}), random}, 1).reshape({-1});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto special = torch::randn({3 * kQuantBlockSize});
  special[3] = nan;
  special[7] = -nan;
  special[kQuantBlockSize + 5] = 1e38f;  // not inf: the lerp would make it NaN (0 * inf)
  special[2 * kQuantBlockSize + 1] = -3e38f;
  special[2 * kQuantBlockSize + 2] = 1e-45f;
  g = torch::cat({g, edges(QuantMap::kSignedDynamic), edges(QuantMap::kUnsignedDynamic), special, torch::randn({100})});
  const auto m_ref = quantize_blockwise(g, QuantMap::kSignedDynamic);
  const auto v_ref = quantize_blockwise(g * g, QuantMap::kUnsignedDynamic);
  for (const auto& kernel : kernels()) {
    const VbmiScope vbmi(kernel.vbmi);
    auto param = torch::zeros_like(g);
    param.mutable_grad() = g;
    Adam opt({param}, AdamOptions(1e-3).betas({0.0, 0.0}).state_dtype(AdamStateDtype::kInt8));
    opt.set_kernel_isa(kernel.isa);
    opt.step();
    const auto& st = static_cast<const AdamParamState&>(*opt.state().at(param.unsafeGetTensorImpl()));
    EXPECT_TRUE(torch::equal(st.exp_avg(), m_ref.first)) << kernel.name() << ": exp_avg codes";
    EXPECT_TRUE(torch::equal(st.exp_avg_absmax(), m_ref.second)) << kernel.name() << ": exp_avg absmax";
    EXPECT_TRUE(torch::equal(st.exp_avg_sq(), v_ref.first)) << kernel.name() << ": exp_avg_sq codes";
    EXPECT_TRUE(torch::equal(st.exp_avg_sq_absmax(), v_ref.second)) << kernel.name() << ": exp_avg_sq absmax";
  }
  // Two steps with the usual betas: the second dequantizes the first's codes of these values, so
  // every kernel's dequantize and update must give the scalar kernel's bits (NaNs included).
  const auto two_steps = [&](const Kernel& kernel) {
    const VbmiScope vbmi(kernel.vbmi);
    auto param = torch::zeros_like(g);
    Adam opt({param}, AdamOptions(1e-3).state_dtype(AdamStateDtype::kInt8));
    opt.set_kernel_isa(kernel.isa);
    for (const auto& grad : {g, g.flip(0)}) {
      param.mutable_grad() = grad;
      opt.step();
    }
    const auto& st = static_cast<const AdamParamState&>(*opt.state().at(param.unsafeGetTensorImpl()));
    return std::vector<torch::Tensor>{param.view(torch::kInt), st.exp_avg(), st.exp_avg_absmax().view(torch::kInt),
                                      st.exp_avg_sq(), st.exp_avg_sq_absmax().view(torch::kInt)};
  };
  const auto expected = two_steps({CpuIsa::kScalar, true});
  for (const auto& kernel : kernels()) {
    const auto got = two_steps(kernel);
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_TRUE(torch::equal(got[k], expected[k])) << kernel.name() << ": two steps, tensor " << k;
    }
  }
}

// Note [Decade code lookup] (optim/detail/quant_map.h) rests on float rounding staying away from
// the thresholds outside its ambiguous band: the AVX-512 lookup, gather fallback included, gives
// quantize_code's code for every float bit pattern, both maps (~30 s; every 61st pattern in
// sanitizer builds, which are several times slower).
TEST(AdamInt8Test, Avx512CodeLookupEqualsTheScalarOneForEveryFloat) {
#if defined(__x86_64__)
  if (!cpu_supports(CpuIsa::kAvx512)) {
    GTEST_SKIP() << "the CPU has no AVX-512";
  }
  const uint64_t stride = roundpipe::testing::kSanitizerBuild ? 61 : 1;
  std::vector<float> x(size_t{1} << 20);
  std::vector<uint8_t> codes(x.size());
  for (const bool is_signed : {true, false}) {
    const detail::QuantMapTable& map = is_signed ? detail::signed_dynamic_map() : detail::unsigned_dynamic_map();
    int64_t checked = 0;
    int64_t mismatches = 0;
    std::string first;
    for (uint64_t start = 0; start < (uint64_t{1} << 32); start += x.size() * stride) {
      size_t n = 0;
      for (; n < x.size() && start + n * stride < (uint64_t{1} << 32); ++n) {
        const auto bits = static_cast<uint32_t>(start + n * stride);
        std::memcpy(&x[n], &bits, sizeof(bits));
      }
      detail::quantize_scaled_avx512(x.data(), static_cast<int64_t>(n), map, codes.data());
      for (size_t i = 0; i < n; ++i) {
        const uint8_t expected = detail::quantize_code(map, x[i]);
        if (codes[i] != expected && mismatches++ == 0) {
          std::ostringstream os;
          os << "x = " << x[i] << " (bits " << std::hex << start + i * stride << std::dec << "): code " << int{codes[i]}
             << ", expected " << int{expected};
          first = os.str();
        }
      }
      checked += static_cast<int64_t>(n);
    }
    EXPECT_EQ(mismatches, 0) << (is_signed ? "signed" : "unsigned") << " map, first: " << first;
    EXPECT_EQ(checked, static_cast<int64_t>(((uint64_t{1} << 32) + stride - 1) / stride));
  }
#else
  GTEST_SKIP() << "the AVX-512 kernel is built on x86 only";
#endif
}

}  // namespace
}  // namespace roundpipe::optim
