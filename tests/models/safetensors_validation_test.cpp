// SafetensorsFile::open on malformed files: one hand-crafted file per rule of Note [Header
// validation] (asserting the error text), and seeded random mutations of a valid file (every
// outcome is a valid file or a c10::Error, never a crash; run it under ASan too).
#include "roundpipe/models/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "tests/common/test_macros.h"
#include "tests/models/test_files.h"

namespace roundpipe::models {
namespace {

using roundpipe::testing::read_bytes;
using roundpipe::testing::ScratchDir;
using roundpipe::testing::write_bytes;

std::string le64(uint64_t n) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
  return bytes;
}

// 8-byte length (the header's own unless given) + header + data.
std::string file_bytes(const std::string& header, const std::string& data, int64_t length = -1) {
  return le64(length < 0 ? header.size() : static_cast<uint64_t>(length)) + header + data;
}

// Opening `bytes` fails with a message that names the file and contains `text`.
void expect_rejected(const std::string& bytes, const std::string& text) {
  ScratchDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_bytes(path, bytes);
  EXPECT_THROW_WITH(SafetensorsFile::open(path), "safetensors file '" + path + "': " + text);
}

const std::string kF32x2 = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

TEST(SafetensorsTest, Open_ValidHandCraftedFile_Accepted) {
  // Unpadded header, keys in any order, null metadata, tensor entries in any order.
  ScratchDir dir;
  write_bytes(dir.file("ok"),
              file_bytes(R"({"b":{"shape":[1],"data_offsets":[8,12],"dtype":"I32"},"__metadata__":null,"a":)" + kF32x2 +
                             "}",
                         std::string(12, '\x01')));
  const auto file = SafetensorsFile::open(dir.file("ok"));
  EXPECT_EQ(file->names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(file->get("b").item<int32_t>(), 0x01010101);
  EXPECT_TRUE(file->metadata().empty());
}

TEST(SafetensorsTest, Open_MissingFile_Error) {
  EXPECT_THROW_WITH(SafetensorsFile::open("/nonexistent/x.safetensors"),
                    "safetensors file '/nonexistent/x.safetensors': cannot open: No such file or directory");
}

TEST(SafetensorsTest, Open_FileShorterThan8Bytes_Error) {
  expect_rejected("", "file is 0 bytes, smaller than the 8-byte header length field");
  expect_rejected(std::string("\x02\0\0\0\0", 5), "file is 5 bytes, smaller than the 8-byte header length field");
}

TEST(SafetensorsTest, Open_HeaderLengthOverLimit_Error) {
  expect_rejected(file_bytes("{}", "", 100'000'001), "header length 100000001 exceeds the limit of 100000000 bytes");
  expect_rejected(le64(~uint64_t{1}) + "{}", "header length 18446744073709551614 exceeds the limit");
}

TEST(SafetensorsTest, Open_HeaderLengthPastEndOfFile_Error) {
  expect_rejected(file_bytes("{}", "", 3), "header length 3 runs past the end of the file (10 bytes");
}

TEST(SafetensorsTest, Open_HeaderNotUtf8_Error) {
  expect_rejected(file_bytes("{\"a\xff\":1}", ""), "header is not valid UTF-8 (byte 3 of the header)");
  expect_rejected(file_bytes("{\"\xC0\xAF\":1}", ""), "header is not valid UTF-8");        // overlong '/'
  expect_rejected(file_bytes("{\"\xED\xA0\x80\":1}", ""), "header is not valid UTF-8");    // surrogate
  expect_rejected(file_bytes("{\"a\"}  \xE2\x82", ""), "header is not valid UTF-8 (byte 7");  // cut short
}

TEST(SafetensorsTest, Open_HeaderNotJson_Error) {
  expect_rejected(file_bytes(R"({"a":)", ""), "header is not valid JSON");
  expect_rejected(file_bytes("", ""), "header is not valid JSON");
  expect_rejected(file_bytes("{}x", ""), "header is not valid JSON");
  expect_rejected(file_bytes(std::string(1000, '[') + std::string(1000, ']'), ""),
                  "header JSON nests deeper than 16 levels");
}

TEST(SafetensorsTest, Open_HeaderNotObject_Error) {
  expect_rejected(file_bytes("[]      ", ""), "header must be a JSON object, got array");
  expect_rejected(file_bytes("7", ""), "header must be a JSON object, got number");
}

TEST(SafetensorsTest, Open_MetadataNotStringMap_Error) {
  expect_rejected(file_bytes(R"({"__metadata__":"pt"})", ""),
                  "\"__metadata__\" must be an object mapping strings to strings, got string");
  expect_rejected(file_bytes(R"({"__metadata__":{"format":"pt","n":1}})", ""),
                  "\"__metadata__\" must map strings to strings, but key 'n' holds number 1");
}

TEST(SafetensorsTest, Open_EntryNotObject_Error) {
  expect_rejected(file_bytes(R"({"a":[1,2]})", ""), "tensor 'a': header entry must be a JSON object, got array");
}

TEST(SafetensorsTest, Open_EntryKeysNotExactlyDtypeShapeOffsets_Error) {
  const std::string rule = "tensor 'a': header entry must have exactly the keys dtype, shape, data_offsets";
  expect_rejected(file_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", ""), rule);
  expect_rejected(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":0}})", std::string(8, '\0')),
                  rule);
  expect_rejected(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"offsets":[0,8]}})", std::string(8, '\0')), rule);
}

TEST(SafetensorsTest, Open_UnknownOrUnsupportedDtype_Error) {
  expect_rejected(file_bytes(R"({"a":{"dtype":"F17","shape":[],"data_offsets":[0,0]}})", ""),
                  "tensor 'a': unknown dtype \"F17\" (supported: BOOL, U8, I8, F8_E5M2");
  expect_rejected(file_bytes(R"({"a":{"dtype":"f32","shape":[],"data_offsets":[0,4]}})", std::string(4, '\0')),
                  "tensor 'a': unknown dtype \"f32\"");
  expect_rejected(file_bytes(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", std::string(1, '\0')),
                  "tensor 'a': dtype F4 is not supported by RoundPipe");
  expect_rejected(file_bytes(R"({"a":{"dtype":4,"shape":[],"data_offsets":[0,4]}})", std::string(4, '\0')),
                  "tensor 'a': dtype must be a string, got 4");
}

TEST(SafetensorsTest, Open_ShapeNotNonNegativeIntegers_Error) {
  const std::string rule = "tensor 'a': shape must be an array of non-negative integers";
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", ""), rule + ", got [-1]");
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", "xx"), rule);
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":2,"data_offsets":[0,2]}})", "xx"), rule);
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,2]}})", "xx"),
                  rule);  // 2^64: not a u64
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}})", ""),
                  "tensor 'a': shape dimension 9223372036854775808 does not fit in int64");
}

TEST(SafetensorsTest, Open_DataOffsetsMalformed_Error) {
  const std::string rule = "tensor 'a': data_offsets must be [begin, end] (two non-negative integers)";
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0]}})", "xx"), rule + ", got [0]");
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}})", "xx"), rule);
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[-1,1]}})", "xx"), rule);
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":"0,2"}})", "xx"), rule);
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[4,2]}})", "xx"),
                  "tensor 'a': data_offsets [4, 2] have begin > end");
}

TEST(SafetensorsTest, Open_OffsetsWithGapOrOverlap_Error) {
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", "xxxx"),
                  "tensor 'a': data_offsets [2, 4] start at 2 but the tensor before it ends at 0 (tensors must tile "
                  "the data section from offset 0 with no gap or overlap)");
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                             "xxxxxx"),
                  "tensor 'b': data_offsets [2, 6] start at 2 but the tensor before it ends at 4");
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                             R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                             "xxxxx"),
                  "tensor 'b': data_offsets [3, 5] start at 3 but the tensor before it ends at 2");
}

TEST(SafetensorsTest, Open_ShapeOverflows_Error) {
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,2],"data_offsets":[0,0]}})", ""),
                  "tensor 'a': shape [4294967296, 4294967296, 2] overflows");
  expect_rejected(file_bytes(R"({"a":{"dtype":"F64","shape":[1152921504606846976,2],"data_offsets":[0,0]}})", ""),
                  "tensor 'a': shape [1152921504606846976, 2] overflows");  // 2^61 elements fit, 2^64 bytes do not
  expect_rejected(file_bytes(R"({"a":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})", ""),
                  "tensor 'a': shape [0, 4294967296, 4294967296] overflows");  // 0 elements, but no int64 strides
}

TEST(SafetensorsTest, Open_SizeDisagreesWithShapeAndDtype_Error) {
  expect_rejected(file_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "xxxxxxxx"),
                  "tensor 'a': shape [3] of dtype F32 needs 12 bytes but data_offsets [0, 8] span 8 bytes");
}

TEST(SafetensorsTest, Open_DataSectionLengthDiffers_Error) {
  const std::string header = "{\"a\":" + kF32x2 + "}";
  expect_rejected(file_bytes(header, std::string(12, '\0')),
                  "the tensors cover 8 bytes but the data section holds 12 (file of ");
  expect_rejected(file_bytes(header, std::string(7, '\0')),
                  "the tensors cover 8 bytes but the data section holds 7");
  expect_rejected(file_bytes("{}", "x"), "the tensors cover 0 bytes but the data section holds 1");
}

TEST(SafetensorsTest, Open_ZeroSizeTensorsAndNoTensors_Accepted) {
  ScratchDir dir;
  write_bytes(dir.file("a"), file_bytes(R"({"z":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},)"
                                        R"("s":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                                        R"("y":{"dtype":"BF16","shape":[5,0],"data_offsets":[8,8]}})",
                                        std::string(8, '\0')));
  const auto file = SafetensorsFile::open(dir.file("a"));
  EXPECT_EQ(file->names(), (std::vector<std::string>{"z", "s", "y"}));
  EXPECT_EQ(file->get("z").sizes(), at::IntArrayRef({0, 3}));
  EXPECT_EQ(file->get("y").scalar_type(), at::kBFloat16);
  EXPECT_EQ(file->get("s").dim(), 0);
  EXPECT_EQ(file->get("s").item<int64_t>(), 0);
  write_bytes(dir.file("b"), file_bytes("{}", ""));
  EXPECT_TRUE(SafetensorsFile::open(dir.file("b"))->names().empty());
}

TEST(SafetensorsTest, Open_MisalignedData_ReturnsAlignedCopy) {
  // Not something safetensors writes: an F32 tensor at data offset 1.
  ScratchDir dir;
  const float value = 1.5f;
  const std::string data = "x" + std::string(reinterpret_cast<const char*>(&value), 4);
  std::string header = R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("f":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}})";
  header.append((8 - header.size() % 8) % 8, ' ');  // data section 8-aligned: "f" sits at an odd address
  write_bytes(dir.file("m"), file_bytes(header, data));
  const auto file = SafetensorsFile::open(dir.file("m"));
  const at::Tensor f = file->get("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.const_data_ptr()) % 4, 0u);
  EXPECT_EQ(f.item<float>(), 1.5f);
}

// Note [Mutation fuzzing]: seeded, so failures reproduce; the mutations aim at the parser (bytes of
// the header and its length field) more than at the data, whose bytes are never interpreted.
TEST(SafetensorsTest, Open_RandomMutations_ValidOrErrorNeverCrash) {
  ScratchDir dir;
  const std::string source = dir.file("source");
  at::manual_seed(0);
  save_safetensors(source,
                   {{"embed", at::randn({4, 3})},
                    {"norm", at::ones({3}, at::kBFloat16)},
                    {"mask", at::ones({5}, at::kBool)},
                    {"ids", at::arange(6, at::kLong)},
                    {"empty", at::empty({0, 2}, at::kHalf)}},
                   {{"format", "pt"}});
  const std::string original = read_bytes(source);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | static_cast<uint8_t>(original[i]);

  std::mt19937_64 rng(20240611);
  const auto pick = [&](uint64_t n) { return n == 0 ? 0 : std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  const std::string tokens = "{}[]\",:-.0123456789eE \\u\x80\xff" "aFIUBL";
  const std::string path = dir.file("mutant");
  int accepted = 0, rejected = 0;
  constexpr int kMutants = 4000;
  for (int iteration = 0; iteration < kMutants; ++iteration) {
    std::string bytes = original;
    const int edits = 1 + static_cast<int>(pick(3));
    for (int e = 0; e < edits; ++e) {
      const uint64_t header_pos = 8 + pick(std::max<uint64_t>(1, std::min<uint64_t>(header_length, bytes.size() - 8)));
      switch (pick(7)) {
        case 0:  // flip one bit anywhere
          if (!bytes.empty()) bytes[pick(bytes.size())] ^= static_cast<char>(1u << pick(8));
          break;
        case 1:  // truncate
          bytes.resize(pick(bytes.size() + 1));
          break;
        case 2: {  // new header length: near the old one, or anything
          const uint64_t length = pick(2) ? header_length + pick(17) - 8 : rng();
          if (bytes.size() >= 8) bytes.replace(0, 8, le64(length));
          break;
        }
        case 3:  // overwrite a header byte with a JSON-ish token
          if (header_pos < bytes.size()) bytes[header_pos] = tokens[pick(tokens.size())];
          break;
        case 4:  // delete a header byte
          if (header_pos < bytes.size()) bytes.erase(header_pos, 1);
          break;
        case 5:  // insert a token into the header
          if (header_pos <= bytes.size()) bytes.insert(header_pos, 1, tokens[pick(tokens.size())]);
          break;
        case 6:  // change a digit (shapes and offsets)
          for (int tries = 0; tries < 50 && bytes.size() > 8; ++tries) {
            const uint64_t at = 8 + pick(std::min<uint64_t>(header_length, bytes.size() - 8));
            if (at < bytes.size() && bytes[at] >= '0' && bytes[at] <= '9') {
              bytes[at] = static_cast<char>('0' + pick(10));
              break;
            }
          }
          break;
      }
    }
    ::unlink(path.c_str());  // a fresh file, not a truncated one: ext4 flushes rewrites on close
    write_bytes(path, bytes);
    try {
      const auto file = SafetensorsFile::open(path);
      for (const auto& name : file->names()) {
        const at::Tensor t = file->get(name);
        // Touch every byte (ASan or a SIGSEGV would catch a bad offset).
        if (t.numel() > 0) {
          (void)t.reshape({-1}).view(at::kByte).to(at::kLong).sum().item<int64_t>();
        }
      }
      ++accepted;
    } catch (const c10::Error&) {
      ++rejected;
    }
  }
  EXPECT_EQ(accepted + rejected, kMutants);
  EXPECT_GT(rejected, kMutants / 2);  // most mutations break something
  EXPECT_GT(accepted, 0);             // and some stay valid (data bytes, digits that still fit)
  RecordProperty("accepted", accepted);
  RecordProperty("rejected", rejected);
}

}  // namespace
}  // namespace roundpipe::models
