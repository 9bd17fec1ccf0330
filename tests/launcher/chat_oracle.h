// tests/launcher/chat_oracle.py from the CLI tests (cli_chat_test.cpp, cli_generate_test.cpp): runs
// it with the oracle Python and returns its stdout (a failed run is a test failure showing stderr).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "launcher_test_util.h"
#include "tests/models/test_files.h"

namespace roundpipe::launcher::testing {

/// `chat_oracle.py ARGS` in `dir` (its stdout and stderr go to files there).
inline std::string run_chat_oracle(const ScratchDir& dir, const std::string& args) {
  const std::string out = dir.file(".oracle.out"), err = dir.file(".oracle.err");
  const std::string cmd = std::string("TOKENIZERS_PARALLELISM=false \"") + ROUNDPIPE_TEST_PYTHON + "\" \"" +
                          ROUNDPIPE_SOURCE_DIR + "/tests/launcher/chat_oracle.py\" " + args + " > \"" + out +
                          "\" 2> \"" + err + "\"";
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(status, 0) << read_file(err);
  return read_file(out);
}

}  // namespace roundpipe::launcher::testing
