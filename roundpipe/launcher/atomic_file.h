// Crash-safe file-system helpers of the launcher: atomic file writes, atomic directory publishing
// (checkpoints), an atomically updated `latest` symlink and keep-last-K pruning of `step-NNNNNN`
// directories. POSIX only (no std::filesystem: see the helper notes on LibTorch's broken copies).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace roundpipe::launcher {

// Note [Atomic publish]:
// Every writer here follows the same order: write into a temporary sibling (same directory, so
// same file system), fsync it, rename(2) it over the final name, fsync the parent directory. A
// crash at any point leaves either the complete old state or the complete new state, plus at most
// a temporary (".tmp.*" file or ".tmp-*" directory) that `remove_stale_temporaries` deletes.
// Directories cannot be renamed over a non-empty directory, so `publish_directory` swaps them with
// renameat2(RENAME_EXCHANGE) when the final directory already exists (falling back to
// rename-aside + rename on file systems without it).
//
// Thread-safety of everything in this header: the functions may be called from any thread, but
// two concurrent writers of the same path race (last rename wins). Errors throw c10::Error naming
// the path, the failing call and errno's text.

/// Writes all `size` bytes to `fd`, retrying short writes and EINTR; returns 0, or the errno of the
/// failing write (EIO for a write that wrote nothing). Never throws (callable from callbacks that
/// must not, such as torch's archive writer).
int write_fully(int fd, const char* data, size_t size);

/// Writes `contents` to `path` atomically (see Note [Atomic publish]); the file gets mode 0644.
void write_file_atomically(const std::string& path, std::string_view contents);

/// Reads a whole file; throws c10::Error naming the path when it cannot be read.
std::string read_file(const std::string& path);

/// Makes `final_dir` the (fully written) directory `tmp_dir` in one step: `tmp_dir` is fsynced and
/// renamed to `final_dir`; an existing `final_dir` is replaced (and deleted). Both must be in the
/// same parent directory. The caller fsyncs the files inside `tmp_dir` (write_file_atomically
/// does). On failure `final_dir` is left as it was and `tmp_dir` still exists.
void publish_directory(const std::string& tmp_dir, const std::string& final_dir);

/// Creates a fresh, empty staging directory beside `final_dir` (".tmp-<name>.<pid>.<n>") and
/// returns its path; fill it, then publish_directory(staging, final_dir).
std::string make_staging_directory(const std::string& final_dir);

/// Points the symlink `link` at `target` (stored as given: pass a name relative to the link's
/// directory, e.g. "step-000100", so the run directory can be moved). Replaces an existing link
/// atomically; throws if `link` exists and is not a symlink.
void update_symlink_atomically(const std::string& link, const std::string& target);

/// The target of symlink `link`, or nullopt when `link` does not exist or is not a symlink.
std::optional<std::string> read_symlink(const std::string& link);

/// "step-000042" (six digits minimum; wider steps print in full).
std::string step_dir_name(int64_t step);
/// The step of a name made by step_dir_name ("step-" and digits only), else nullopt.
std::optional<int64_t> parse_step_dir_name(std::string_view name);

/// The steps of the `step-NNNNNN` directories in `parent`, ascending (symlinks are not counted).
/// Empty when `parent` does not exist.
std::vector<int64_t> list_step_dirs(const std::string& parent);

/// Deletes all but the `keep` highest `step-NNNNNN` directories in `parent` (keep >= 1), never the
/// one that `parent/latest` points to. Returns the deleted directories' paths, oldest first.
std::vector<std::string> prune_step_dirs(const std::string& parent, int64_t keep);

/// Deletes leftovers of interrupted writes in `parent` (".tmp.*" files, ".tmp-*" directories, see
/// Note [Atomic publish]). Call once at start, before any writer runs. Returns the deleted paths.
std::vector<std::string> remove_stale_temporaries(const std::string& parent);

/// mkdir -p; existing directories are fine. Throws naming the component that could not be made.
void make_directories(const std::string& path);
/// rm -rf (does not follow symlinks); a missing path is fine.
void remove_tree(const std::string& path);
/// fsyncs a directory (makes renames and creations inside it durable).
void fsync_directory(const std::string& path);
/// True when `path` exists (lstat).
bool path_exists(const std::string& path);
/// True when `path` is a directory (stat: follows symlinks).
bool is_directory(const std::string& path);
/// True when `path` is a regular file (stat: follows symlinks).
bool is_regular_file(const std::string& path);
/// The directory part of `path` ("." when it has none).
std::string parent_directory(const std::string& path);
/// `dir` + "/" + `name` (no doubled slash).
std::string join_path(const std::string& dir, const std::string& name);

namespace detail {
/// Test hook: called at named points of the writers ("write_file:before_rename",
/// "publish_directory:before_rename", "symlink:before_rename"); a hook that throws simulates a
/// crash there. Process-wide; not thread-safe: set it only while no writer runs. Empty = none.
using FailureHook = std::function<void(std::string_view point)>;
void set_failure_hook(FailureHook hook);
}  // namespace detail

}  // namespace roundpipe::launcher
