// GradScalerState and its archive I/O (torch::save / torch::load).
#include "amp/grad_scaler.h"

#include <torch/serialize/archive.h>

namespace roundpipe::amp {

void GradScalerState::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", c10::IValue(scale));
  archive.write("growth_factor", c10::IValue(growth_factor));
  archive.write("backoff_factor", c10::IValue(backoff_factor));
  archive.write("growth_interval", c10::IValue(growth_interval));
  archive.write("growth_tracker", c10::IValue(growth_tracker));
  archive.write("empty", c10::IValue(empty));
}

void GradScalerState::load(torch::serialize::InputArchive& archive) {
  auto read = [&archive](const char* key) {
    c10::IValue value;
    TORCH_CHECK(archive.try_read(key, value), "GradScalerState::load: the archive has no key '", key,
                "' (was it written by GradScalerState::save?)");
    return value;
  };
  auto read_double = [&read](const char* key) {
    auto value = read(key);
    TORCH_CHECK(value.isDouble(), "GradScalerState::load: key '", key, "' holds a ", value.tagKind(),
                ", expected a double");
    return value.toDouble();
  };
  auto read_int = [&read](const char* key) {
    auto value = read(key);
    TORCH_CHECK(value.isInt(), "GradScalerState::load: key '", key, "' holds a ", value.tagKind(),
                ", expected an int");
    return value.toInt();
  };
  GradScalerState loaded;
  loaded.scale = read_double("scale");
  loaded.growth_factor = read_double("growth_factor");
  loaded.backoff_factor = read_double("backoff_factor");
  loaded.growth_interval = read_int("growth_interval");
  loaded.growth_tracker = read_int("growth_tracker");
  auto empty_value = read("empty");
  TORCH_CHECK(empty_value.isBool(), "GradScalerState::load: key 'empty' holds a ", empty_value.tagKind(),
              ", expected a bool");
  loaded.empty = empty_value.toBool();
  *this = loaded;
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScalerState& state) {
  state.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScalerState& state) {
  state.load(archive);
  return archive;
}

}  // namespace roundpipe::amp
