#include "base/thread_budget.h"

namespace roundpipe::base {
namespace {

thread_local int64_t budget = 0;  // owned by its thread

}  // namespace

int64_t thread_budget() { return budget; }

void set_thread_budget(int64_t threads) { budget = threads < 0 ? 0 : threads; }

}  // namespace roundpipe::base
