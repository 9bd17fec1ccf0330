#include "scheduler/planner.h"

#include <gtest/gtest.h>

namespace roundpipe::scheduler {
namespace {
}  // namespace
}  // namespace roundpipe::scheduler
