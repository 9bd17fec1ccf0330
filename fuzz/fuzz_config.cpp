// libFuzzer target: the launcher's config loader (YAML text + dotted key=value overrides).
// Input: YAML text, optionally followed by a line "%%" and one override per line. Any input must
// either be refused with ConfigError (never another exception or a crash) or give a configuration
// that to_yaml writes out and parse_config reads back to the same YAML (to_yaml's promise).
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "fuzz/fuzz_file.h"
#include "roundpipe/launcher/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace launcher = roundpipe::launcher;
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::string yaml = text;
  std::vector<std::string> overrides;
  const size_t split = text.find("\n%%\n");
  if (split != std::string::npos) {
    yaml = text.substr(0, split + 1);
    size_t begin = split + 4;
    while (begin <= text.size()) {
      size_t end = text.find('\n', begin);
      if (end == std::string::npos) end = text.size();
      if (end > begin) overrides.push_back(text.substr(begin, end - begin));
      begin = end + 1;
    }
  }
  launcher::LauncherConfig config;
  try {
    config = launcher::parse_config(yaml, overrides, "<fuzz>");
  } catch (const launcher::ConfigError&) {
    return 0;  // refused with a message naming the key
  }
  const std::string written = launcher::to_yaml(config);
  std::string reread;
  try {
    reread = launcher::to_yaml(launcher::parse_config(written, {}, "<to_yaml>"));
  } catch (const launcher::ConfigError& e) {
    std::fprintf(stderr, "to_yaml output does not load: %s\n--- to_yaml:\n%s\n", e.what(), written.c_str());
    std::abort();
  }
  if (reread != written) {
    std::fprintf(stderr, "--- to_yaml:\n%s\n--- after reloading:\n%s\n", written.c_str(), reread.c_str());
  }
  ROUNDPIPE_FUZZ_CHECK(reread == written, "to_yaml(parse_config(to_yaml(c))) == to_yaml(c)");
  return 0;
}
