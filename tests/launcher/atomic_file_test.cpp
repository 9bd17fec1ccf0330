#include "roundpipe/launcher/atomic_file.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "launcher_test_util.h"
#include "tests/common/test_macros.h"

namespace roundpipe::launcher {
namespace {

using testing::ScratchDir;

/// Installs a failure hook that throws at `point` for the scope's lifetime.
class InjectFailure {
 public:
  explicit InjectFailure(std::string point) {
    detail::set_failure_hook([point](std::string_view at) {
      if (at == point) {
        throw std::runtime_error("injected failure at " + point);
      }
    });
  }
  ~InjectFailure() { detail::set_failure_hook(nullptr); }
};

/// The ".tmp*" leftovers in `dir` (deleted by the call).
std::vector<std::string> temporaries(const std::string& dir) {
  return remove_stale_temporaries(dir);
}

TEST(AtomicFileTest, WriteFile_ReplacesContents) {
  ScratchDir dir;
  write_file_atomically(dir.file("a.txt"), "old");
  write_file_atomically(dir.file("a.txt"), "new contents");
  EXPECT_EQ(read_file(dir.file("a.txt")), "new contents");
  EXPECT_TRUE(temporaries(dir.path()).empty());
}

TEST(AtomicFileTest, WriteFile_FailureBeforeRenameKeepsOldContents) {
  ScratchDir dir;
  write_file_atomically(dir.file("a.txt"), "old");
  {
    InjectFailure failure("write_file:before_rename");
    EXPECT_THROW(write_file_atomically(dir.file("a.txt"), "new"), std::runtime_error);
  }
  EXPECT_EQ(read_file(dir.file("a.txt")), "old");
  EXPECT_TRUE(temporaries(dir.path()).empty());  // the temporary was removed
  EXPECT_THROW_WITH(write_file_atomically(dir.file("missing/a.txt"), "x"), "missing");
}

TEST(AtomicFileTest, PublishDirectory_CreatesAndReplaces) {
  ScratchDir dir;
  const std::string final_dir = dir.file(step_dir_name(5));
  std::string staging = make_staging_directory(final_dir);
  write_file_atomically(join_path(staging, "model.bin"), "v1");
  publish_directory(staging, final_dir);
  EXPECT_EQ(read_file(join_path(final_dir, "model.bin")), "v1");
  EXPECT_FALSE(path_exists(staging));
  // Publishing the same step again replaces the whole directory.
  staging = make_staging_directory(final_dir);
  write_file_atomically(join_path(staging, "other.bin"), "v2");
  publish_directory(staging, final_dir);
  EXPECT_EQ(read_file(join_path(final_dir, "other.bin")), "v2");
  EXPECT_FALSE(path_exists(join_path(final_dir, "model.bin")));
  EXPECT_TRUE(temporaries(dir.path()).empty());
}

TEST(AtomicFileTest, PublishDirectory_FailureBeforeRenameKeepsOldState) {
  ScratchDir dir;
  const std::string final_dir = dir.file(step_dir_name(5));
  std::string staging = make_staging_directory(final_dir);
  write_file_atomically(join_path(staging, "model.bin"), "old");
  publish_directory(staging, final_dir);
  staging = make_staging_directory(final_dir);
  write_file_atomically(join_path(staging, "model.bin"), "new");
  {
    InjectFailure failure("publish_directory:before_rename");
    EXPECT_THROW(publish_directory(staging, final_dir), std::runtime_error);
  }
  EXPECT_EQ(read_file(join_path(final_dir, "model.bin")), "old");
  EXPECT_TRUE(is_directory(staging));  // the caller's staging directory is left to clean up
  EXPECT_EQ(temporaries(dir.path()).size(), 1u);
  EXPECT_FALSE(path_exists(staging));
}

TEST(AtomicFileTest, Symlink_UpdatesAtomicallyAndSurvivesFailure) {
  ScratchDir dir;
  const std::string link = dir.file("latest");
  update_symlink_atomically(link, "step-000001");
  EXPECT_EQ(read_symlink(link), "step-000001");
  update_symlink_atomically(link, "step-000002");
  EXPECT_EQ(read_symlink(link), "step-000002");
  {
    InjectFailure failure("symlink:before_rename");
    EXPECT_THROW(update_symlink_atomically(link, "step-000003"), std::runtime_error);
  }
  EXPECT_EQ(read_symlink(link), "step-000002");
  EXPECT_TRUE(temporaries(dir.path()).empty());
  write_file_atomically(dir.file("plain"), "x");
  EXPECT_THROW_WITH(update_symlink_atomically(dir.file("plain"), "step-000001"), "not a symlink");
  EXPECT_FALSE(read_symlink(dir.file("plain")).has_value());
}

TEST(AtomicFileTest, StepDirNames_RoundTrip) {
  EXPECT_EQ(step_dir_name(42), "step-000042");
  EXPECT_EQ(step_dir_name(12345678), "step-12345678");
  EXPECT_EQ(parse_step_dir_name("step-000042"), 42);
  EXPECT_EQ(parse_step_dir_name("step-12345678"), 12345678);
  EXPECT_FALSE(parse_step_dir_name("step-").has_value());
  EXPECT_FALSE(parse_step_dir_name("step-12a").has_value());
  EXPECT_FALSE(parse_step_dir_name("latest").has_value());
}

TEST(AtomicFileTest, Prune_KeepsNewestAndTheLatestTarget) {
  ScratchDir dir;
  for (int64_t step : {1, 2, 3, 4, 5, 10}) {
    make_directories(dir.file(step_dir_name(step)));
    write_file_atomically(join_path(dir.file(step_dir_name(step)), "m.bin"), "x");
  }
  make_directories(dir.file("other"));
  update_symlink_atomically(dir.file("latest"), step_dir_name(2));
  std::vector<std::string> removed = prune_step_dirs(dir.path(), 2);
  EXPECT_EQ(removed, (std::vector<std::string>{dir.file("step-000001"), dir.file("step-000003"),
                                               dir.file("step-000004")}));
  EXPECT_EQ(list_step_dirs(dir.path()), (std::vector<int64_t>{2, 5, 10}));
  EXPECT_TRUE(is_directory(dir.file("other")));
  EXPECT_TRUE(path_exists(dir.file("latest")));
  update_symlink_atomically(dir.file("latest"), step_dir_name(10));
  EXPECT_EQ(prune_step_dirs(dir.path(), 2), std::vector<std::string>{dir.file("step-000002")});
  EXPECT_EQ(list_step_dirs(dir.path()), (std::vector<int64_t>{5, 10}));
  EXPECT_THROW_WITH(prune_step_dirs(dir.path(), 0), "keep must be >= 1");
}

TEST(AtomicFileTest, MakeDirectories_CreatesNestedPaths) {
  ScratchDir dir;
  make_directories(dir.file("a/b/c"));
  EXPECT_TRUE(is_directory(dir.file("a/b/c")));
  make_directories(dir.file("a/b/c"));  // existing: fine
  write_file_atomically(dir.file("a/file"), "x");
  EXPECT_THROW_WITH(make_directories(dir.file("a/file/d")), "a/file");
  remove_tree(dir.file("a"));
  EXPECT_FALSE(path_exists(dir.file("a")));
}

}  // namespace
}  // namespace roundpipe::launcher
