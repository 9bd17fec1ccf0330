// GradScaler: PyTorch's own GradScaler tests (test_torch.py / test_cuda.py) ported to C++, with
// closed-form or fp32-control references, on CPU and (as *_CUDA twins) on the GPU.
#include "amp/detail/unscale.h"
#include "amp/grad_scaler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>

#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"

namespace roundpipe::amp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

torch::TensorOptions f32(const c10::Device& device) { return torch::TensorOptions().dtype(torch::kFloat).device(device); }

// One SGD(lr) optimizer over `params`, all with gradients set to `grads`.
struct OneParamSetup {
  std::vector<torch::Tensor> params;
  std::unique_ptr<torch::optim::SGD> opt;
};

OneParamSetup make_setup(const std::vector<torch::Tensor>& initial, double lr = 1.0) {
  OneParamSetup s;
  for (const auto& p : initial) s.params.push_back(p.clone().set_requires_grad(true));
  s.opt = std::make_unique<torch::optim::SGD>(s.params, torch::optim::SGDOptions(lr));
  return s;
}

// ---- Raw op and unscale_ on contiguous / transposed / sliced gradients (test_grad_scaling_unscale)

void unscale_op_case(const c10::Device& device) {
  auto inv_scale = torch::full({1}, 0.25, f32(device));
  auto found_inf = torch::zeros({1}, f32(device));
  const int64_t size = 10;
  auto g = torch::full({size, size}, 4.0, f32(device));
  std::vector<torch::Tensor> grads = {g.clone(), g.clone().t(), torch::full({size, size * 2}, 4.0, f32(device))
                                                                     .slice(/*dim=*/1, 0, size * 2, /*step=*/2)};
  ASSERT_FALSE(grads[1].is_contiguous());
  ASSERT_EQ(grads[2].stride(1), 2);
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
  for (const auto& grad : grads) EXPECT_TRUE(torch::equal(grad, torch::ones_like(grad)));

  // inf or NaN in any tensor of the list is found.
  for (float bad : {kInf, std::nanf("")}) {
    for (size_t which = 0; which < grads.size(); ++which) {
      std::vector<torch::Tensor> list = {g.clone(), g.clone().t(),
                                         torch::full({size, size * 2}, 4.0, f32(device)).slice(1, 0, size * 2, 2)};
      list[which][6][7] = bad;
      found_inf.zero_();
      at::_amp_foreach_non_finite_check_and_unscale_(list, found_inf, inv_scale);
      EXPECT_EQ(found_inf.item<float>(), 1.0f) << "bad value " << bad << " in grad " << which;
    }
  }

  // Mixed fp32 / fp16 lists work (fp16 is upcast for the check).
  std::vector<torch::Tensor> mixed = {g.clone(), g.clone().to(torch::kHalf)};
  found_inf.zero_();
  at::_amp_foreach_non_finite_check_and_unscale_(mixed, found_inf, inv_scale);
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
  EXPECT_TRUE(torch::equal(mixed[1], torch::ones_like(mixed[1])));
  mixed[1][1][1] = kInf;
  at::_amp_foreach_non_finite_check_and_unscale_(mixed, found_inf, inv_scale);
  EXPECT_EQ(found_inf.item<float>(), 1.0f);
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, UnscaleOp_ContiguousTransposedSlicedGrads, unscale_op_case)

void unscale_layouts_case(const c10::Device& device) {
  auto s = make_setup({torch::zeros({10, 10}, f32(device)), torch::zeros({10, 10}, f32(device)),
                       torch::zeros({10, 10}, f32(device))});
  GradScaler scaler(GradScalerOptions().init_scale(4.0));
  auto loss = scaler.scale(torch::ones({}, f32(device)));
  EXPECT_EQ(loss.item<float>(), 4.0f);
  auto values = torch::arange(100, f32(device)).reshape({10, 10}) * 4;
  s.params[0].mutable_grad() = values.clone();
  s.params[1].mutable_grad() = values.clone().t();
  auto wide = torch::zeros({10, 20}, f32(device));
  wide.slice(1, 0, 20, 2).copy_(values);
  s.params[2].mutable_grad() = wide.slice(1, 0, 20, 2);
  ASSERT_EQ(s.params[2].grad().stride(1), 2);
  std::vector<torch::Tensor> expected = {values / 4, values.t() / 4, values / 4};
  scaler.unscale_(*s.opt);
  for (size_t i = 0; i < 3; ++i) EXPECT_TENSOR_EQ(s.params[i].grad(), expected[i]);
  EXPECT_FALSE(s.params[1].grad().is_contiguous());
  EXPECT_TRUE(scaler.step(*s.opt));
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(s.params[i].detach(), -expected[i]));

  // An inf in one of them (here the sliced one) skips the whole step.
  scaler.update();
  auto before = s.params[0].detach().clone();
  s.params[2].mutable_grad()[3][4] = kInf;
  EXPECT_FALSE(scaler.step(*s.opt));
  EXPECT_TENSOR_EQ(s.params[0].detach(), before);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 2.0);  // no growth (interval 2000), one backoff
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Unscale_ContiguousTransposedSlicedGrads, unscale_layouts_case)

TEST(GradScalerTest, NonFiniteCheck_BucketsPerDevice) {
  auto inv = torch::full({}, 0.5, torch::kFloat);
  std::vector<torch::Tensor> grads = {torch::full({3}, 2.0), torch::Tensor(), torch::full({2}, 4.0, torch::kDouble),
                                      torch::full({2}, 6.0, torch::kBFloat16)};
  auto found = detail::non_finite_check_and_unscale(grads, inv, /*allow_fp16=*/false);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].first, c10::Device(c10::kCPU));
  EXPECT_EQ(found[0].second.item<float>(), 0.0f);
  EXPECT_TRUE(torch::equal(grads[0], torch::full({3}, 1.0)));
  EXPECT_TRUE(torch::equal(grads[2], torch::full({2}, 2.0, torch::kDouble)));
  EXPECT_TRUE(torch::equal(grads[3], torch::full({2}, 3.0, torch::kBFloat16)));
  grads[3][0] = kInf;
  EXPECT_EQ(detail::non_finite_check_and_unscale(grads, torch::ones({}), false)[0].second.item<float>(), 1.0f);
  EXPECT_TRUE(detail::non_finite_check_and_unscale({torch::Tensor()}, inv, false).empty());
}

TEST(GradScalerTest, NonFiniteCheck_MixedDevices_CUDA) {
  std::vector<torch::Tensor> grads = {torch::full({3}, 2.0), torch::full({3}, 2.0, f32(c10::Device(c10::kCUDA, 0)))};
  grads[1][2] = kInf;
  auto found = detail::non_finite_check_and_unscale(grads, torch::full({}, 0.5), false);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_TRUE(found[0].first.is_cpu());
  EXPECT_EQ(found[0].second.item<float>(), 0.0f);
  EXPECT_TRUE(found[1].first.is_cuda());
  EXPECT_TRUE(found[1].second.is_cuda());
  EXPECT_EQ(found[1].second.item<float>(), 1.0f);
  EXPECT_TRUE(torch::equal(grads[0], torch::ones({3})));
}

// ---- update rule (test_grad_scaling_update_scale, test_grad_scale_will_not_overflow) -----------

// One iteration through the public API: grads finite or not, then update().
void iterate(GradScaler& scaler, OneParamSetup& s, const c10::Device& device, bool inf) {
  s.opt->zero_grad();
  s.params[0].mutable_grad() = scaler.scale(torch::ones({2}, f32(device)));
  if (inf) s.params[0].mutable_grad()[1] = kInf;
  EXPECT_EQ(scaler.step(*s.opt), !inf);
  scaler.update();
}

void update_rule_case(const c10::Device& device) {
  GradScaler scaler(GradScalerOptions().init_scale(4.0).growth_factor(2.0).backoff_factor(0.25).growth_interval(2));
  auto s = make_setup({torch::zeros({2}, f32(device))}, /*lr=*/0.0);
  iterate(scaler, s, device, false);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 1);
  EXPECT_EQ(scaler.get_scale(), 4.0);
  iterate(scaler, s, device, false);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 0);
  EXPECT_EQ(scaler.get_scale(), 8.0);
  iterate(scaler, s, device, true);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 0);
  EXPECT_EQ(scaler.get_scale(), 2.0);
  EXPECT_EQ(scaler.scale_tensor().device(), device);

  // The rule compares with ==: an interval at or below the tracker stops growth until an inf.
  scaler.set_growth_interval(3);
  iterate(scaler, s, device, false);
  iterate(scaler, s, device, false);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 2);
  scaler.set_growth_interval(2);
  for (int i = 0; i < 4; ++i) iterate(scaler, s, device, false);
  EXPECT_EQ(scaler.get_scale(), 2.0);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 6);
  iterate(scaler, s, device, true);
  EXPECT_EQ(scaler.get_scale(), 0.5);
  iterate(scaler, s, device, false);
  iterate(scaler, s, device, false);
  EXPECT_EQ(scaler.get_scale(), 1.0);
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Update_GrowthBackoffAndTracker, update_rule_case)

void will_not_overflow_case(const c10::Device& device) {
  GradScaler scaler(GradScalerOptions().init_scale(1e38).growth_factor(16.0).growth_interval(1));
  auto s = make_setup({torch::zeros({2}, f32(device))}, 0.0);
  s.params[0].mutable_grad() = scaler.scale(torch::full({2}, 1e-10, f32(device)));
  EXPECT_TRUE(scaler.step(*s.opt));
  scaler.update();
  EXPECT_TRUE(std::isfinite(scaler.get_scale()));
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(1e38f));  // growth to inf refused, scale kept
  EXPECT_EQ(scaler.state_dict().growth_tracker, 0);
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Update_WillNotOverflow, will_not_overflow_case)

void new_scale_case(const c10::Device& device) {
  GradScaler scaler(GradScalerOptions().init_scale(8.0).growth_interval(2));
  auto s = make_setup({torch::zeros({2}, f32(device))}, 0.0);
  iterate(scaler, s, device, false);
  scaler.scale(torch::ones({}, f32(device)));
  scaler.update(0.1);  // fills the float32 scale: rounded to float, tracker untouched
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(0.1f));
  EXPECT_EQ(scaler.state_dict().growth_tracker, 1);
  iterate(scaler, s, device, false);
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(static_cast<float>(double(0.1f) * 2.0)));
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Update_NewScaleKeepsTracker, new_scale_case)

// ---- state_dict (test_grad_scaling_state_dict) ---------------------------------------------------

void state_dict_case(const c10::Device& device) {
  for (bool lazy_init : {true, false}) {
    GradScaler s0(GradScalerOptions().init_scale(3.0).growth_factor(4.0).backoff_factor(0.5).growth_interval(2));
    GradScaler s1(GradScalerOptions().init_scale(6.0).growth_factor(7.0).backoff_factor(0.8).growth_interval(1));
    GradScalerState with_tracker = s1.state_dict();
    with_tracker.growth_tracker = 7;
    s1.load_state_dict(with_tracker);
    EXPECT_EQ(s1.state_dict().growth_tracker, 7);
    if (lazy_init) {
      s1.scale(torch::full({1}, 4.0, f32(device)));
      EXPECT_EQ(s1.scale_tensor().device(), device);
      EXPECT_EQ(s1.scale_tensor().scalar_type(), torch::kFloat);
      EXPECT_EQ(s1.state_dict().growth_tracker, 7);
    } else {
      EXPECT_FALSE(s1.scale_tensor().defined());
    }
    // Before lazy init the state carries the options' scale and tracker 0, like torch.
    auto sd = s0.state_dict();
    EXPECT_EQ(sd.scale, 3.0);
    EXPECT_EQ(sd.growth_tracker, 0);
    EXPECT_FALSE(sd.empty);
    s1.load_state_dict(sd);
    EXPECT_EQ(s1.get_scale(), 3.0);
    EXPECT_EQ(s1.get_growth_factor(), 4.0);
    EXPECT_EQ(s1.get_backoff_factor(), 0.5);
    EXPECT_EQ(s1.get_growth_interval(), 2);
    EXPECT_EQ(s1.state_dict().growth_tracker, 0);
    if (lazy_init) {
      EXPECT_EQ(s1.scale_tensor().device(), device);  // tensor kept, filled in place
      EXPECT_EQ(s1.scale_tensor().item<float>(), 3.0f);
    }
    // The loaded values drive the next update: 2 finite iterations grow 3 -> 12.
    auto s = make_setup({torch::zeros({2}, f32(device))}, 0.0);
    iterate(s1, s, device, false);
    iterate(s1, s, device, false);
    EXPECT_EQ(s1.get_scale(), 12.0);
  }
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, StateDict_RoundTripBeforeAndAfterLazyInit, state_dict_case)

void archive_case(const c10::Device& device) {
  GradScaler s0(GradScalerOptions().init_scale(1024.0).growth_factor(3.0).backoff_factor(0.25).growth_interval(2));
  auto s = make_setup({torch::zeros({2}, f32(device))}, 0.0);
  iterate(s0, s, device, false);
  iterate(s0, s, device, false);
  iterate(s0, s, device, false);  // scale 3072, tracker 1
  std::stringstream stream;
  {
    torch::serialize::OutputArchive archive;
    archive << s0.state_dict();
    archive.save_to(stream);
  }
  GradScalerState loaded;
  {
    torch::serialize::InputArchive archive;
    archive.load_from(stream);
    archive >> loaded;
  }
  EXPECT_EQ(loaded.scale, 3072.0);
  EXPECT_EQ(loaded.growth_factor, 3.0);
  EXPECT_EQ(loaded.backoff_factor, 0.25);
  EXPECT_EQ(loaded.growth_interval, 2);
  EXPECT_EQ(loaded.growth_tracker, 1);
  EXPECT_FALSE(loaded.empty);
  // torch::save / torch::load find the archive operators by ADL.
  std::stringstream saved;
  torch::save(s0.state_dict(), saved);
  GradScalerState via_torch_load;
  torch::load(via_torch_load, saved);
  EXPECT_EQ(via_torch_load.scale, 3072.0);
  EXPECT_EQ(via_torch_load.growth_tracker, 1);
  GradScaler disabled(GradScalerOptions().enabled(false));
  std::stringstream saved_empty;
  torch::save(disabled.state_dict(), saved_empty);
  GradScalerState empty_loaded;
  torch::load(empty_loaded, saved_empty);
  EXPECT_TRUE(empty_loaded.empty);

  GradScaler s1;
  s1.load_state_dict(loaded);
  iterate(s1, s, device, false);  // tracker 1 -> 2 == interval: grows
  EXPECT_EQ(s1.get_scale(), 9216.0);

  torch::serialize::InputArchive missing;
  std::stringstream empty_stream;
  {
    torch::serialize::OutputArchive archive;
    archive.write("scale", c10::IValue(1.0));
    archive.save_to(empty_stream);
  }
  missing.load_from(empty_stream);
  GradScalerState target;
  EXPECT_THROW_WITH(missing >> target, "no key 'growth_factor'");
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, StateDict_ThroughSerializeArchive, archive_case)

// ---- Control-vs-scaled training cases (torch's _create_scaling_case / _run_scaling_case) --------

struct ScalingCase {
  torch::nn::Sequential control{nullptr}, scaling{nullptr};
  std::unique_ptr<torch::optim::SGD> opt_control, opt_scaling;
};

torch::nn::Sequential make_model(const c10::Device& device) {
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  model->to(device);
  return model;
}

ScalingCase make_scaling_models(const c10::Device& device) {
  ScalingCase c;
  c.control = make_model(device);
  c.scaling = make_model(device);
  {
    torch::NoGradGuard no_grad;
    auto cp = c.control->parameters();
    auto sp = c.scaling->parameters();
    for (size_t i = 0; i < cp.size(); ++i) sp[i].copy_(cp[i]);
  }
  c.opt_control = std::make_unique<torch::optim::SGD>(c.control->parameters(), torch::optim::SGDOptions(1.0));
  c.opt_scaling = std::make_unique<torch::optim::SGD>(c.scaling->parameters(), torch::optim::SGDOptions(1.0));
  return c;
}

using Data = std::vector<std::pair<torch::Tensor, torch::Tensor>>;
constexpr int kSkipIter = 2;

Data make_data(const c10::Device& device) {
  Data data;
  for (int i = 0; i < 4; ++i) data.emplace_back(torch::randn({8, 8}, f32(device)), torch::randn({8, 8}, f32(device)));
  return data;
}

torch::Tensor mse(const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); }

using RunFn = std::function<void(const Data&, torch::nn::Sequential&, torch::optim::SGD&, GradScaler&, bool)>;

void expect_params_close(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  auto pa = a->parameters();
  auto pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(testing::tensors_close(pb[i], pa[i], 1e-5, 1e-5)) << "param " << i;
}

void run_scaling_case(const c10::Device& device, const RunFn& run, int unskipped, int skipped) {
  for (bool enabled : {true, false}) {
    torch::manual_seed(0);
    auto c = make_scaling_models(device);
    auto data = make_data(device);
    GradScaler scaler(GradScalerOptions().init_scale(128.0).growth_factor(2.0).growth_interval(1).enabled(enabled));
    run(data, c.control, *c.opt_control, scaler, false);
    run(data, c.scaling, *c.opt_scaling, scaler, true);
    if (enabled) {
      EXPECT_EQ(scaler.get_scale(), 128.0 * std::pow(2.0, unskipped) * std::pow(0.5, skipped));
    } else {
      EXPECT_EQ(scaler.get_scale(), 1.0);
    }
    expect_params_close(c.control, c.scaling);
  }
}

void clipping_separate_unscale_case(const c10::Device& device) {
  run_scaling_case(
      device,
      [](const Data& data, torch::nn::Sequential& model, torch::optim::SGD& opt, GradScaler& scaler, bool scaling) {
        const double max_norm = 0.2;
        for (size_t i = 0; i < data.size(); ++i) {
          opt.zero_grad();
          auto loss = mse(model->forward(data[i].first), data[i].second);
          if (scaling) {
            scaler.scale(loss).backward();
            if (static_cast<int>(i) == kSkipIter && scaler.is_enabled()) {
              model->parameters()[2].mutable_grad().fill_(kInf);
            }
            scaler.unscale_(opt);
            torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm, 2.0, /*error_if_nonfinite=*/false);
            scaler.step(opt);
            scaler.update();
          } else {
            loss.backward();
            torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
            if (!scaler.is_enabled() || static_cast<int>(i) != kSkipIter) opt.step();
          }
        }
      },
      3, 1);
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Clipping_SeparateUnscaleMatchesControl, clipping_separate_unscale_case)

void accumulation_case(const c10::Device& device) {
  run_scaling_case(
      device,
      [](const Data& data, torch::nn::Sequential& model, torch::optim::SGD& opt, GradScaler& scaler, bool scaling) {
        const int iters_to_accumulate = 2;
        for (size_t i = 0; i < data.size(); ++i) {
          auto loss = mse(model->forward(data[i].first), data[i].second) / iters_to_accumulate;
          if (scaling) {
            scaler.scale(loss).backward();
          } else {
            loss.backward();
          }
          if ((i + 1) % iters_to_accumulate == 0) {
            if (scaling) {
              scaler.step(opt);
              scaler.update();
            } else {
              opt.step();
            }
            opt.zero_grad();
          }
        }
      },
      2, 0);
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Accumulation_MatchesControl, accumulation_case)

void multiple_case(const c10::Device& device) {
  for (bool enabled : {true, false}) {
    torch::manual_seed(0);
    auto c0 = make_scaling_models(device);
    auto c1 = make_scaling_models(device);
    auto data = make_data(device);
    GradScaler scaler(GradScalerOptions().init_scale(128.0).growth_factor(2.0).growth_interval(1).enabled(enabled));
    auto run = [&](torch::nn::Sequential& model0, torch::nn::Sequential& model1, torch::optim::SGD& opt0,
                   torch::optim::SGD& opt1, bool scaling) {
      for (size_t i = 0; i < data.size(); ++i) {
        opt0.zero_grad();
        opt1.zero_grad();
        auto out0 = model0->forward(data[i].first);
        auto out1 = model1->forward(data[i].first);
        auto loss0 = mse(0.3 * out0 + 0.7 * out1, data[i].second);
        auto loss1 = mse(0.6 * out0 - 0.4 * out1, data[i].second);
        if (scaling) {
          scaler.scale(loss0).backward({}, /*retain_graph=*/true);
          scaler.scale(loss1).backward();
          if (static_cast<int>(i) == kSkipIter && scaler.is_enabled()) model1->parameters()[2].mutable_grad().fill_(kInf);
          scaler.unscale_(opt0);  // separately unscale one of the optimizers, as torch does
          EXPECT_TRUE(scaler.step(opt0));
          EXPECT_EQ(scaler.step(opt1), !(static_cast<int>(i) == kSkipIter && scaler.is_enabled()));
          scaler.update();
        } else {
          loss0.backward({}, true);
          loss1.backward();
          opt0.step();
          if (!scaler.is_enabled() || static_cast<int>(i) != kSkipIter) opt1.step();
        }
      }
    };
    run(c0.control, c1.control, *c0.opt_control, *c1.opt_control, false);
    run(c0.scaling, c1.scaling, *c0.opt_scaling, *c1.opt_scaling, true);
    EXPECT_EQ(scaler.get_scale(), enabled ? 128.0 * 8.0 * 0.5 : 1.0);
    expect_params_close(c0.control, c0.scaling);
    expect_params_close(c1.control, c1.scaling);
  }
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Multiple_TwoModelsTwoOptimizersOneScaler, multiple_case)

void invalidated_case(const c10::Device& device) {
  // test_params_invalidated_with_grads_invalidated_between_unscale_and_step: the inf check happens
  // at unscale_ time only.
  for (float bad : {kInf, std::nanf("")}) {
    auto s = make_setup({torch::ones({4}, f32(device))});
    GradScaler scaler;
    s.params[0].mutable_grad() = scaler.scale(torch::ones({4}, f32(device)));
    scaler.unscale_(*s.opt);
    s.params[0].mutable_grad().fill_(bad);
    EXPECT_TRUE(scaler.step(*s.opt));
    scaler.update();
    EXPECT_FALSE(torch::isfinite(s.params[0]).all().item<bool>());
  }
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Step_GradsInvalidatedAfterUnscaleStillStep, invalidated_case)

// ---- scale() --------------------------------------------------------------------------------

TEST(GradScalerTest, Scale_ListKeepsOrderAndLazyInitsOnFirstDevice) {
  GradScaler scaler(GradScalerOptions().init_scale(2.0));
  EXPECT_TRUE(scaler.scale(std::vector<torch::Tensor>{}).empty());
  EXPECT_FALSE(scaler.scale_tensor().defined());
  auto out = scaler.scale({torch::full({2}, 4.0), torch::full({3}, 3.0, torch::kDouble)});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(torch::equal(out[0], torch::full({2}, 8.0)));
  EXPECT_TRUE(torch::equal(out[1], torch::full({3}, 6.0, torch::kDouble)));
  EXPECT_TRUE(scaler.scale_tensor().is_cpu());
}

TEST(GradScalerTest, Scale_MultiDeviceList_CUDA) {
  GradScaler scaler(GradScalerOptions().init_scale(2.0));
  auto cuda = c10::Device(c10::kCUDA, 0);
  auto out = scaler.scale({torch::full({2}, 4.0, f32(cuda)), torch::full({2}, 4.0)});
  EXPECT_TRUE(out[0].is_cuda());
  EXPECT_TRUE(out[1].is_cpu());
  EXPECT_TRUE(torch::equal(out[0].cpu(), torch::full({2}, 8.0)));
  EXPECT_TRUE(torch::equal(out[1], torch::full({2}, 8.0)));
  EXPECT_TRUE(scaler.scale_tensor().is_cuda());
}

// ---- Errors -------------------------------------------------------------------------------------

void errors_case(const c10::Device& device) {
  auto s = make_setup({torch::zeros({2}, f32(device))});
  GradScaler scaler;
  EXPECT_THROW_WITH(scaler.unscale_(*s.opt), "Attempted unscale_ but _scale is None.");
  EXPECT_THROW_WITH(scaler.step(*s.opt), "Attempted step but _scale is None.");
  EXPECT_THROW_WITH(scaler.update(), "Attempted update but _scale is None.");

  s.params[0].mutable_grad() = scaler.scale(torch::ones({2}, f32(device)));
  scaler.unscale_(*s.opt);
  EXPECT_THROW_WITH(scaler.unscale_(*s.opt),
                    "unscale_() has already been called on this optimizer since the last update().");
  EXPECT_TRUE(scaler.step(*s.opt));
  EXPECT_THROW_WITH(scaler.step(*s.opt), "step() has already been called since the last update().");
  EXPECT_THROW_WITH(scaler.unscale_(*s.opt), "unscale_() is being called after step().");
  scaler.update();
  // After update() every optimizer is READY again.
  s.params[0].mutable_grad() = scaler.scale(torch::ones({2}, f32(device)));
  EXPECT_TRUE(scaler.step(*s.opt));
  scaler.update();

  // No gradients at all.
  s.opt->zero_grad();  // sets grads to undefined (set_to_none)
  ASSERT_FALSE(s.params[0].grad().defined());
  EXPECT_THROW_WITH(scaler.step(*s.opt), "No inf checks were recorded for this optimizer.");
  GradScaler fresh;
  fresh.scale(torch::ones({}, f32(device)));
  EXPECT_THROW_WITH(fresh.update(), "No inf checks were recorded prior to update.");

  // fp16 gradients are rejected (a c10::ValueError, as torch raises ValueError), nothing unscaled.
  auto half = make_setup({torch::zeros({2}, f32(device)).to(torch::kHalf), torch::zeros({2}, f32(device))});
  GradScaler scaler16(GradScalerOptions().init_scale(4.0));
  half.params[1].mutable_grad() = scaler16.scale(torch::ones({2}, f32(device)));
  half.params[0].mutable_grad() = torch::ones({2}, f32(device).dtype(torch::kHalf));
  EXPECT_THROW(scaler16.unscale_(*half.opt), c10::ValueError);
  EXPECT_THROW_WITH(scaler16.step(*half.opt), "Attempting to unscale FP16 gradients.");
  EXPECT_TRUE(torch::equal(half.params[1].grad().cpu(), torch::full({2}, 4.0)));

  GradScalerState empty_state;
  empty_state.empty = true;
  EXPECT_THROW_WITH(scaler.load_state_dict(empty_state),
                    "The source state dict is empty, possibly because it was saved from a disabled instance of "
                    "GradScaler.");
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Errors_MatchTorchMessages, errors_case)

TEST(GradScalerTest, Options_ValidatedInConstructor) {
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().growth_factor(1.0)), "The growth factor must be > 1.0.");
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().backoff_factor(1.0)), "The backoff factor must be < 1.0");
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().backoff_factor(0.0)), "backoff_factor is 0");
  EXPECT_THROW_WITH(GradScaler(GradScalerOptions().growth_interval(0)), "The growth interval must be > 0.");
  // Disabled scalers are not validated, like torch.
  EXPECT_NO_THROW(GradScaler(GradScalerOptions().growth_factor(0.5).enabled(false)));
  GradScaler defaults;
  EXPECT_EQ(defaults.get_scale(), 65536.0);
  EXPECT_EQ(defaults.get_growth_factor(), 2.0);
  EXPECT_EQ(defaults.get_backoff_factor(), 0.5);
  EXPECT_EQ(defaults.get_growth_interval(), 2000);
  EXPECT_TRUE(defaults.is_enabled());
}

// ---- Disabled -----------------------------------------------------------------------------------

void disabled_case(const c10::Device& device) {
  GradScaler scaler(GradScalerOptions().enabled(false));
  EXPECT_FALSE(scaler.is_enabled());
  auto x = torch::full({3}, 2.0, f32(device));
  auto y = scaler.scale(x);
  EXPECT_TRUE(y.is_same(x));
  auto s = make_setup({torch::zeros({3}, f32(device))});
  s.params[0].mutable_grad() = torch::full({3}, kInf, f32(device));
  scaler.unscale_(*s.opt);  // no-op
  EXPECT_TRUE(torch::equal(s.params[0].grad(), torch::full({3}, kInf, f32(device))));
  EXPECT_TRUE(scaler.step(*s.opt));  // plain optimizer.step(), even on infs
  EXPECT_TRUE(torch::isinf(s.params[0]).all().item<bool>());
  EXPECT_TRUE(scaler.step(*s.opt));  // no state machine
  scaler.update();
  scaler.update(5.0);
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_FALSE(scaler.scale_tensor().defined());
  EXPECT_TRUE(scaler.state_dict().empty);
  GradScaler enabled;
  scaler.load_state_dict(enabled.state_dict());  // no-op
  EXPECT_EQ(scaler.get_scale(), 1.0);
}
ROUNDPIPE_DEVICE_TEST(GradScalerTest, Disabled_IsPassThrough, disabled_case)

}  // namespace
}  // namespace roundpipe::amp
