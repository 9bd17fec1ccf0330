// libFuzzer target: the safetensors header parser (SafetensorsFile::open) and zero-copy reads.
// Any input must either be refused with c10::Error or give a file whose tensors satisfy the
// promises of Note [Header validation], checked here against the raw bytes; every byte of every
// tensor is read so that an offset past the mapping faults.
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "fuzz/fuzz_file.h"
#include "roundpipe/models/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using roundpipe::models::SafetensorsFile;
  const std::string path = roundpipe::fuzz::write_input("safetensors", data, size);
  std::shared_ptr<SafetensorsFile> file;
  try {
    file = SafetensorsFile::open(path);
  } catch (const c10::Error&) {
    return 0;  // refused with a message: the contract for malformed files
  }
  // Independent reference: the length field and the file size fix the data section.
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | data[i];
  ROUNDPIPE_FUZZ_CHECK(8 + header_bytes + file->data_bytes() == size, "data section is the rest of the file");

  uint64_t covered = 0;
  for (const std::string& name : file->names()) {
    const auto& info = file->info(name);
    ROUNDPIPE_FUZZ_CHECK(info.begin == covered && info.end >= info.begin, "tensors tile the data section");
    covered = info.end;
    at::Tensor t = file->get(name);
    ROUNDPIPE_FUZZ_CHECK(t.sizes().vec() == info.shape, "shape as in the header");
    ROUNDPIPE_FUZZ_CHECK(t.scalar_type() == info.dtype, "dtype as in the header");
    ROUNDPIPE_FUZZ_CHECK(static_cast<uint64_t>(t.nbytes()) == info.end - info.begin, "size = numel * element size");
    const auto* p = static_cast<const uint8_t*>(t.data_ptr());
    const uint8_t* expected = data + 8 + header_bytes + info.begin;
    for (size_t i = 0; i < t.nbytes(); ++i) {
      ROUNDPIPE_FUZZ_CHECK(p[i] == expected[i], "tensor bytes are the file's bytes");
    }
  }
  ROUNDPIPE_FUZZ_CHECK(covered == file->data_bytes(), "the last tensor ends at the end of the file");
  return 0;
}
