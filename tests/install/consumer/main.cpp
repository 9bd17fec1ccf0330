// Uses the installed RoundPipe: plans a 6-layer model and checks the plan is valid.
#include <roundpipe/roundpipe.h>

#include <iostream>

int main() {
  namespace rs = roundpipe::scheduler;
  auto costs = rs::size_based_costs({10, 10, 10, 10, 10, 10}, {10, 10, 10, 10, 10, 10});
  auto plan = rs::partition(costs, rs::RunType::kFused, rs::PartitionOptions().set_min_stages(2));
  plan.validate(6, rs::RunType::kFused);
  std::cout << "RoundPipe " << ROUNDPIPE_VERSION << " plan: " << plan.to_string() << std::endl;
  return plan.num_stages() > 0 ? 0 : 1;
}
