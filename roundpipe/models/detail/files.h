// Small file helpers of roundpipe::models (internal): atomic text files, directories.
#pragma once

#include <string>

namespace roundpipe::models::detail {

/// Writes `text` to `path` atomically (temporary file, fsync, rename).
void write_text_atomically(const std::string& path, const std::string& text);
/// Creates `dir` if missing (its parent must exist).
void make_directory(const std::string& dir);

}  // namespace roundpipe::models::detail
