// Shared by the fuzz targets whose parser reads a path (safetensors, token files): the input is
// written to a per-process file in /dev/shm (tmpfs, else $TMPDIR or /tmp) and the parser opens it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace roundpipe::fuzz {

/// Writes `size` bytes to this process's scratch file for `tag` (truncating it) and returns its
/// path; the file is removed at exit.
std::string write_input(const std::string& tag, const uint8_t* data, size_t size);

}  // namespace roundpipe::fuzz

/// An invariant of the parser's documented contract; a violation is a finding: print and abort so
/// that libFuzzer saves the input.
#define ROUNDPIPE_FUZZ_CHECK(cond, what)                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s) at %s:%d\n", #cond, what,   \
                   __FILE__, __LINE__);                                                   \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)
