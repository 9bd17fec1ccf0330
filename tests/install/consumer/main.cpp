// Uses the installed RoundPipe: plans a 6-layer model and checks the plan is valid, and encodes
// with the tokenizer (it links PCRE2 and utf8proc through RoundPipeConfig.cmake).
#include <roundpipe/models/tokenizer.h>
#include <roundpipe/roundpipe.h>

#include <iostream>

int main() {
  namespace rs = roundpipe::scheduler;
  auto costs = rs::size_based_costs({10, 10, 10, 10, 10, 10}, {10, 10, 10, 10, 10, 10});
  auto plan = rs::partition(costs, rs::RunType::kFused, rs::PartitionOptions().set_min_stages(2));
  plan.validate(6, rs::RunType::kFused);
  std::cout << "RoundPipe " << ROUNDPIPE_VERSION << " plan: " << plan.to_string() << std::endl;
  const auto tok = roundpipe::models::Tokenizer::from_json(R"({
    "normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}})");
  if (tok.encode("abab") != std::vector<int64_t>{2, 2} || tok.decode({2, 1}) != "abb") {
    std::cerr << "tokenizer: wrong ids" << std::endl;
    return 1;
  }
  return plan.num_stages() > 0 ? 0 : 1;
}
