// SafetensorsFile / save_safetensors: round trips, byte compatibility with Python's `safetensors`
// (and the reference crate's own test vectors), zero-copy reads, dtype conversion, atomic writes.
#include "roundpipe/models/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/models/test_files.h"

namespace roundpipe::models {
namespace {

using roundpipe::testing::read_bytes;
using roundpipe::testing::run_python;
using roundpipe::testing::ScratchDir;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct DtypeCase {
  c10::ScalarType dtype;
  const char* safetensors_name;
  const char* torch_name;
};

const std::vector<DtypeCase>& dtype_cases() {
  static const std::vector<DtypeCase> cases = {
      {at::kBool, "BOOL", "torch.bool"},
      {at::kByte, "U8", "torch.uint8"},
      {at::kChar, "I8", "torch.int8"},
      {at::kShort, "I16", "torch.int16"},
      {at::ScalarType::UInt16, "U16", "torch.uint16"},
      {at::kInt, "I32", "torch.int32"},
      {at::ScalarType::UInt32, "U32", "torch.uint32"},
      {at::kLong, "I64", "torch.int64"},
      {at::ScalarType::UInt64, "U64", "torch.uint64"},
      {at::kHalf, "F16", "torch.float16"},
      {at::kBFloat16, "BF16", "torch.bfloat16"},
      {at::kFloat, "F32", "torch.float32"},
      {at::kDouble, "F64", "torch.float64"},
      {at::kComplexFloat, "C64", "torch.complex64"},
      {at::ScalarType::Float8_e4m3fn, "F8_E4M3", "torch.float8_e4m3fn"},
      {at::ScalarType::Float8_e5m2, "F8_E5M2", "torch.float8_e5m2"},
      {at::ScalarType::Float8_e8m0fnu, "F8_E8M0", "torch.float8_e8m0fnu"},
  };
  return cases;
}

// Random bit patterns of `dtype` (NaNs and all), built as bytes so every dtype works; bools get 0/1.
at::Tensor random_bits(c10::ScalarType dtype, std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  at::Tensor bytes = dtype == at::kBool ? at::randint(0, 2, {numel}, at::kByte)
                                        : at::randint(0, 256, {numel * element}, at::kByte);
  return bytes.view(dtype).reshape(shape);
}

// The logical bytes of `t` (row-major), whatever its dtype.
std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.cpu().resolve_conj().resolve_neg().contiguous();
  return std::string(static_cast<const char*>(c.const_data_ptr()), c.nbytes());
}

::testing::AssertionResult same_bits(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type() || actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "dtype/shape " << actual.scalar_type() << actual.sizes() << " vs "
                                         << expected.scalar_type() << expected.sizes();
  }
  if (bytes_of(actual) != bytes_of(expected)) {
    return ::testing::AssertionFailure() << "bytes differ (" << actual.scalar_type() << actual.sizes() << ")";
  }
  return ::testing::AssertionSuccess();
}

// One tensor per dtype plus a scalar and a zero-size tensor, names out of order on purpose.
NamedTensors every_dtype_tensors() {
  at::manual_seed(7);
  NamedTensors tensors;
  for (const auto& c : dtype_cases()) {
    tensors.emplace_back(std::string("w.") + c.safetensors_name, random_bits(c.dtype, {3, 5}));
  }
  tensors.emplace_back("scalar", random_bits(at::kFloat, {}));
  tensors.emplace_back("empty", random_bits(at::kHalf, {0, 4}));
  std::reverse(tensors.begin(), tensors.end());
  return tensors;
}

std::string substitute(std::string text, const std::map<std::string, std::string>& values) {
  for (const auto& [key, value] : values) {
    for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + value.size())) {
      text.replace(at, key.size(), value);
    }
  }
  return text;
}

// A Python expression for `text` (any bytes that are UTF-8), immune to quoting.
std::string py_str(const std::string& text) {
  std::string hex;
  char digits[3];
  for (unsigned char c : text) {
    std::snprintf(digits, sizeof(digits), "%02x", c);
    hex += digits;
  }
  return "bytes.fromhex('" + hex + "').decode('utf-8')";
}

// Python literal {name: dtype} for the snippets, and the byte views passed as inputs.
std::pair<std::string, roundpipe::testing::TensorMap> python_tensor_spec(const NamedTensors& tensors) {
  std::ostringstream spec;
  roundpipe::testing::TensorMap inputs;
  spec << "{";
  for (const auto& [name, t] : tensors) {
    // Init-capture: C++17 cannot capture a structured binding (clang refuses; gcc accepts).
    const auto& c = *std::find_if(dtype_cases().begin(), dtype_cases().end(),
                                  [&, &t = t](const DtypeCase& d) { return d.dtype == t.scalar_type(); });
    spec << py_str(name) << ": (" << c.torch_name << ", [";
    for (int64_t d : t.sizes()) spec << d << ",";
    spec << "]),";
    inputs[name] = t.contiguous().reshape({-1}).view(at::kByte);
  }
  spec << "}";
  return {spec.str(), inputs};
}

// The reference crate's unit tests (safetensors/src/tensor.rs: test_serialization, test_empty,
// test_serialization_forced_alignement) pin these exact bytes.
TEST(SafetensorsTest, Save_MatchesReferenceCrateTestVectors) {
  ScratchDir dir;
  const auto u8 = [](std::initializer_list<int> v) { return std::string(v.begin(), v.end()); };
  const at::Tensor data = at::arange(6, at::kFloat);
  const std::string data_bytes =
      u8({0, 0, 0, 0, 0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0, 160, 64});

  save_safetensors(dir.file("a"), {{"attn.0", data.reshape({1, 2, 3})}});
  EXPECT_EQ(read_bytes(dir.file("a")),
            u8({64, 0, 0, 0, 0, 0, 0, 0}) + R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})" +
                data_bytes);

  save_safetensors(dir.file("b"), {{"attn0", data.reshape({1, 1, 2, 3})}});
  EXPECT_EQ(read_bytes(dir.file("b")), u8({72, 0, 0, 0, 0, 0, 0, 0}) +
                                           R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" +
                                           std::string(7, ' ') + data_bytes);

  save_safetensors(dir.file("c"), {});
  EXPECT_EQ(read_bytes(dir.file("c")), u8({8, 0, 0, 0, 0, 0, 0, 0}) + "{}" + std::string(6, ' '));
  save_safetensors(dir.file("d"), {}, {{"framework", "pt"}});
  EXPECT_EQ(read_bytes(dir.file("d")),
            u8({40, 0, 0, 0, 0, 0, 0, 0}) + R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' '));

  const auto empty = SafetensorsFile::open(dir.file("c"));
  EXPECT_TRUE(empty->names().empty());
  EXPECT_TRUE(empty->metadata().empty());
  EXPECT_EQ(empty->data_bytes(), 0u);
  EXPECT_EQ(SafetensorsFile::open(dir.file("d"))->metadata().at("framework"), "pt");
}

TEST(SafetensorsTest, RoundTrip_EveryDtype_BitwiseEqual) {
  ScratchDir dir;
  const NamedTensors tensors = every_dtype_tensors();
  save_safetensors(dir.file("m.safetensors"), tensors);
  const auto file = SafetensorsFile::open(dir.file("m.safetensors"));
  ASSERT_EQ(file->names().size(), tensors.size());
  uint64_t total = 0;
  for (const auto& [name, expected] : tensors) {
    ASSERT_TRUE(file->contains(name)) << name;
    const TensorInfo& info = file->info(name);
    EXPECT_EQ(info.name, name);
    EXPECT_EQ(info.dtype, expected.scalar_type()) << name;
    EXPECT_EQ(info.shape, expected.sizes().vec()) << name;
    EXPECT_EQ(info.end - info.begin, expected.nbytes()) << name;
    EXPECT_TRUE(same_bits(file->get(name), expected)) << name;
    total += expected.nbytes();
  }
  EXPECT_EQ(file->data_bytes(), total);
  // names() follows the data offsets.
  uint64_t previous_end = 0;
  for (const auto& name : file->names()) {
    EXPECT_EQ(file->info(name).begin, previous_end) << name;
    previous_end = file->info(name).end;
  }
}

// /proc/self/maps ranges backed by `path`.
std::vector<std::pair<uintptr_t, uintptr_t>> mapped_ranges(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (std::string line; std::getline(maps, line);) {
    if (line.size() > path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0) {
      uintptr_t begin = 0, end = 0;
      std::sscanf(line.c_str(), "%lx-%lx", &begin, &end);
      ranges.emplace_back(begin, end);
    }
  }
  return ranges;
}

TEST(SafetensorsTest, Get_ZeroCopy_DataLiesInTheMappingAndOutlivesTheFile) {
  ScratchDir dir;
  const std::string path = dir.file("z.safetensors");
  const at::Tensor weight = at::randn({64, 33});
  save_safetensors(path, {{"w", weight}, {"b", at::randn({7}, at::kDouble)}});

  auto file = SafetensorsFile::open(path);
  at::Tensor w = file->get("w");
  const auto ranges = mapped_ranges(path);
  ASSERT_FALSE(ranges.empty()) << "the file is not mapped";
  const auto in_mapping = [&](const at::Tensor& t) {
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    return std::any_of(ranges.begin(), ranges.end(), [&](const auto& r) {
      return begin >= r.first && begin + t.nbytes() <= r.second;
    });
  };
  EXPECT_TRUE(in_mapping(w));
  EXPECT_TRUE(in_mapping(file->get("b")));
  EXPECT_TRUE(w.is_contiguous());
  EXPECT_EQ(file->get("w").const_data_ptr(), w.const_data_ptr());
  EXPECT_EQ(file->get("w", at::kFloat).const_data_ptr(), w.const_data_ptr());  // same dtype: no copy
  EXPECT_FALSE(in_mapping(file->get("w", at::kHalf)));

  // The tensor keeps the mapping alive after the file object is gone.
  file.reset();
  EXPECT_FALSE(mapped_ranges(path).empty());
  EXPECT_TENSOR_EQ(w, weight);
  const at::Tensor view = w.slice(0, 3, 9);
  const void* view_data = view.const_data_ptr();
  w = at::Tensor();  // the view alone keeps the mapping
  EXPECT_TENSOR_EQ(view, weight.slice(0, 3, 9));
  EXPECT_EQ(view.const_data_ptr(), view_data);
}

// Resident KiB of this process's mappings of `path` (the Rss lines of /proc/self/smaps).
int64_t mapped_rss_kib(const std::string& path) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in_file = false;
  int64_t kib = 0;
  while (std::getline(smaps, line)) {
    const bool header = !line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
                        line.find('-') != std::string::npos && line.find(':') > line.find(' ');
    if (header) {
      in_file = line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
    } else if (in_file && line.rfind("Rss:", 0) == 0) {
      kib += std::stoll(line.substr(4));
    }
  }
  return kib;
}

// Note [Releasing mapped pages]: release_pages drops the tensor's pages from the resident set; the
// tensor stays readable with the same bytes.
TEST(SafetensorsTest, ReleasePages_ShrinksResidentSetAndKeepsTensorsValid) {
  ScratchDir dir;
  const std::string path = dir.file("r.safetensors");
  const at::Tensor big = at::randn({8 << 20});  // 32 MiB
  const at::Tensor small = at::arange(10, at::kFloat);
  save_safetensors(path, {{"big", big}, {"small", small}});
  auto file = SafetensorsFile::open(path);
  at::Tensor view = file->get("big");
  EXPECT_TENSOR_EQ(view, big);  // reads every page
  EXPECT_GE(mapped_rss_kib(path), 32 << 10);
  file->release_pages("big");
  EXPECT_LT(mapped_rss_kib(path), 64);  // at most the header's and `small`'s pages
  EXPECT_TENSOR_EQ(view, big);          // faulted back in with the same bytes
  EXPECT_GE(mapped_rss_kib(path), 32 << 10);
  file->release_pages("big");
  file->release_pages("small");
  EXPECT_TENSOR_EQ(file->get("small"), small);
}

TEST(SafetensorsTest, Get_MissingTensor_ErrorNamesFileAndTensor) {
  ScratchDir dir;
  save_safetensors(dir.file("m"), {{"present", at::ones({2})}});
  const auto file = SafetensorsFile::open(dir.file("m"));
  EXPECT_FALSE(file->contains("absent"));
  EXPECT_THROW_WITH(file->info("absent"), "safetensors file '" + dir.file("m") + "' has no tensor 'absent'");
  EXPECT_THROW_WITH(file->get("absent"), "has no tensor 'absent'");
}

TEST(SafetensorsTest, Metadata_RoundTrip_EscapesAndUnicode) {
  ScratchDir dir;
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"quote\"back\\slash", "line\nfeed\ttab\x01" "ctl"},
      {"unicod\xC3\xA9", "\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80"},
      {"empty", ""}};
  save_safetensors(dir.file("m"), {{"x", at::ones({1})}}, metadata);
  EXPECT_EQ(SafetensorsFile::open(dir.file("m"))->metadata(), metadata);
}

TEST(SafetensorsTest, Save_NonContiguousAndConjugate_WritesLogicalValues) {
  ScratchDir dir;
  const at::Tensor base = at::randn({6, 8});
  const at::Tensor complex = at::randn({4}, at::kComplexFloat);
  const NamedTensors tensors = {{"transposed", base.t()},
                                {"strided", base.slice(1, 0, 8, 3)},
                                {"expanded", at::randn({1, 5}).expand({4, 5})},
                                {"conj", complex.conj()},
                                {"neg", at::imag(complex.conj())}};
  save_safetensors(dir.file("m"), tensors);
  const auto file = SafetensorsFile::open(dir.file("m"));
  for (const auto& [name, t] : tensors) {
    const at::Tensor expected = t.resolve_conj().resolve_neg().contiguous();
    EXPECT_TRUE(same_bits(file->get(name), expected)) << name;
  }
}

void save_from_device(c10::Device device) {
  ScratchDir dir;
  const at::Tensor host = at::randn({16, 3}).to(at::kBFloat16);
  save_safetensors(dir.file("m"), {{"w", host.to(device).t()}});
  EXPECT_TRUE(same_bits(SafetensorsFile::open(dir.file("m"))->get("w"), host.t().contiguous()));
}
ROUNDPIPE_DEVICE_TEST(SafetensorsTest, Save_DeviceTensor_WritesHostCopy, save_from_device)

TEST(SafetensorsTest, Save_InvalidInput_ErrorsNamingTheTensor) {
  ScratchDir dir;
  const std::string path = dir.file("m");
  EXPECT_THROW_WITH(save_safetensors(path, {{"a", at::Tensor()}}), "tensor 'a' is undefined");
  EXPECT_THROW_WITH(save_safetensors(path, {{"a", at::ones({1})}, {"a", at::ones({1})}}), "'a' appears twice");
  EXPECT_THROW_WITH(save_safetensors(path, {{"c", at::ones({1}, at::kComplexDouble)}}),
                    "tensor 'c' has dtype ComplexDouble, which safetensors cannot store");
  EXPECT_THROW_WITH(save_safetensors(path, {{"__metadata__", at::ones({1})}}), "\"__metadata__\" is reserved");
  EXPECT_THROW_WITH(save_safetensors(path, {{"bad\xff", at::ones({1})}}), "is not valid UTF-8");
  EXPECT_THROW_WITH(save_safetensors(dir.file("no/such/dir/m"), {{"a", at::ones({1})}}), "cannot create");
  EXPECT_TRUE(roundpipe::testing::list_dir(dir.path()).empty());
}

TEST(SafetensorsTest, AtomicWrite_Success_LeavesNoTemporaryFile) {
  ScratchDir dir;
  save_safetensors(dir.file("m.safetensors"), {{"a", at::ones({3})}});
  save_safetensors(dir.file("m.safetensors"), {{"b", at::zeros({5})}});  // replaces
  EXPECT_EQ(roundpipe::testing::list_dir(dir.path()), std::vector<std::string>{"m.safetensors"});
  EXPECT_EQ(SafetensorsFile::open(dir.file("m.safetensors"))->names(), std::vector<std::string>{"b"});
}

TEST(SafetensorsTest, AtomicWrite_RejectedInput_KeepsPreviousFile) {
  ScratchDir dir;
  const std::string path = dir.file("m.safetensors");
  save_safetensors(path, {{"a", at::arange(10, at::kFloat)}});
  const std::string before = read_bytes(path);
  // The undefined tensor comes after a valid one: nothing is written before validation ends.
  EXPECT_THROW_WITH(save_safetensors(path, {{"big", at::randn({1000})}, {"x", at::Tensor()}}), "is undefined");
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(roundpipe::testing::list_dir(dir.path()), std::vector<std::string>{"m.safetensors"});
}

// A failure in the middle of writing the data (the file-size limit, like a full disk) removes the
// temporary file and leaves the old file in place.
TEST(SafetensorsTest, AtomicWrite_WriteFailsMidway_KeepsPreviousFile) {
  ScratchDir dir;
  const std::string path = dir.file("m.safetensors");
  save_safetensors(path, {{"a", at::arange(10, at::kFloat)}});
  const std::string before = read_bytes(path);

  struct rlimit old_limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  struct sigaction ignore {}, old_action {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &old_action), 0);  // EFBIG instead of a signal
  struct rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string error;
  try {
    save_safetensors(path, {{"big", at::randn({100000})}});
  } catch (const c10::Error& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::sigaction(SIGXFSZ, &old_action, nullptr);

  EXPECT_NE(error.find("writing '" + path + ".tmp."), std::string::npos) << error;
  EXPECT_NE(error.find("File too large"), std::string::npos) << error;
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(roundpipe::testing::list_dir(dir.path()), std::vector<std::string>{"m.safetensors"});
}

// ---- Python interoperability ---------------------------------------------------------------------

TEST(SafetensorsTest, Save_ByteIdenticalToPythonSaveFile) {
  ROUNDPIPE_REQUIRE_PYTHON("safetensors");
  ScratchDir dir;
  NamedTensors tensors = every_dtype_tensors();
  tensors.emplace_back("na\xC3\xAFve \"quoted\\\" \x01 name", at::randn({2}));
  const auto [spec, inputs] = python_tensor_spec(tensors);
  save_safetensors(dir.file("ours"), tensors);
  save_safetensors(dir.file("ours_meta"), tensors, {{"format", "pt"}});
  run_python(substitute(R"PY(
from safetensors.torch import save_file
spec = SPEC
tensors = {name: inputs[name].view(dtype).reshape(shape) for name, (dtype, shape) in spec.items()}
save_file(tensors, 'DIR/theirs')
save_file(tensors, 'DIR/theirs_meta', metadata={'format': 'pt'})
)PY",
                        {{"SPEC", spec}, {"DIR", dir.path()}}),
             inputs);
  EXPECT_EQ(read_bytes(dir.file("ours")), read_bytes(dir.file("theirs")));
  EXPECT_EQ(read_bytes(dir.file("ours_meta")), read_bytes(dir.file("theirs_meta")));
}

TEST(SafetensorsTest, Open_FilesWrittenByPython_BitwiseEqual) {
  ROUNDPIPE_REQUIRE_PYTHON("safetensors");
  ScratchDir dir;
  const auto out = run_python(substitute(R"PY(
import json, struct
from safetensors.torch import save_file
g = torch.Generator().manual_seed(3)
def bits(dtype, shape):
    n = 1
    for d in shape: n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).view(torch.bool).reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)
dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
          torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu]
tensors = {f'layer.{i}.w': bits(d, [2, i + 1, 3]) for i, d in enumerate(dtypes)}
tensors['scalar'] = torch.tensor(2.5)
tensors['zero'] = torch.empty(0, 7, dtype=torch.bfloat16)
save_file(tensors, 'DIR/py.safetensors', metadata={'format': 'pt', 'note': 'x\ny'})
raw = open('DIR/py.safetensors', 'rb').read()
header = json.loads(raw[8:8 + struct.unpack('<Q', raw[:8])[0]])
order = sorted((v['data_offsets'], k) for k, v in header.items() if k != '__metadata__')
for rank, (_, name) in enumerate(order):
    t = tensors[name]
    outputs[name + '/bytes'] = t.reshape(-1).view(torch.uint8).clone()
    outputs[name + '/shape'] = torch.tensor(list(t.shape), dtype=torch.int64)
    outputs[name + '/rank'] = torch.tensor(rank)
)PY",
                                         {{"DIR", dir.path()}}));
  const auto file = SafetensorsFile::open(dir.file("py.safetensors"));
  const std::vector<std::string> names = file->names();
  ASSERT_EQ(names.size() * 3, out.size());
  EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "x\ny"}}));
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    ASSERT_TRUE(out.count(name + "/bytes")) << name;
    EXPECT_EQ(out.at(name + "/rank").item<int64_t>(), static_cast<int64_t>(i)) << name;
    const at::Tensor t = file->get(name);
    EXPECT_EQ(t.sizes().vec(), std::vector<int64_t>(out.at(name + "/shape").data_ptr<int64_t>(),
                                                    out.at(name + "/shape").data_ptr<int64_t>() + t.dim()))
        << name;
    EXPECT_EQ(bytes_of(t), bytes_of(out.at(name + "/bytes"))) << name;
  }
}

TEST(SafetensorsTest, PythonLoadsOurFile_BitwiseEqual) {
  ROUNDPIPE_REQUIRE_PYTHON("safetensors");
  ScratchDir dir;
  const NamedTensors tensors = every_dtype_tensors();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"k\xC3\xA9y", "v\"a\\l\nue"}};
  save_safetensors(dir.file("ours.safetensors"), tensors, metadata);
  const auto [spec, inputs] = python_tensor_spec(tensors);
  const auto out = run_python(substitute(R"PY(
from safetensors import safe_open
from safetensors.torch import load_file
loaded = load_file('DIR/ours.safetensors')
spec = SPEC
outputs['names_match'] = sorted(loaded) == sorted(spec)
outputs['all_equal'] = all(
    loaded[n].dtype == dtype and list(loaded[n].shape) == shape and
    torch.equal(loaded[n].reshape(-1).view(torch.uint8), inputs[n])
    for n, (dtype, shape) in spec.items())
with safe_open('DIR/ours.safetensors', framework='pt') as f:
    outputs['metadata_match'] = f.metadata() == {'format': 'pt', 'k\u00e9y': 'v"a\\l\nue'}
)PY",
                                         {{"SPEC", spec}, {"DIR", dir.path()}}),
                              inputs);
  EXPECT_TRUE(out.at("names_match").item<bool>());
  EXPECT_TRUE(out.at("all_equal").item<bool>());
  EXPECT_TRUE(out.at("metadata_match").item<bool>());
}

TEST(SafetensorsTest, GetWithDtype_Bf16ToFloat_MatchesPythonFloat) {
  ROUNDPIPE_REQUIRE_PYTHON("safetensors");
  ScratchDir dir;
  const at::Tensor stored = at::randn({33, 17}).mul(100).to(at::kBFloat16);
  save_safetensors(dir.file("m"), {{"w", stored}, {"h", at::randn({9}).to(at::kHalf)}});
  const auto out = run_python(substitute(R"PY(
from safetensors.torch import load_file
t = load_file('DIR/m')
outputs['w'] = t['w'].float()
outputs['h'] = t['h'].double()
)PY",
                                         {{"DIR", dir.path()}}));
  const auto file = SafetensorsFile::open(dir.file("m"));
  EXPECT_TENSOR_EQ(file->get("w", at::kFloat), out.at("w"));
  EXPECT_TENSOR_EQ(file->get("h", at::kDouble), out.at("h"));
}

}  // namespace
}  // namespace roundpipe::models
