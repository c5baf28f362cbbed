// Placeholder: built-in reductions are implemented here.
#include "reductions.h"

#include "errors.h"

namespace acs {

std::shared_ptr<Reduction> make_builtin_reduction(const std::string& kind, const ReductionOptions&) {
  ACS_CHECK(false, "reduction kind '", kind, "' is not available yet");
  return nullptr;
}

std::shared_ptr<Reduction> make_script_reduction(const std::string& path, const ReductionOptions&) {
  ACS_CHECK(false, "script reductions are not available yet (", path, ")");
  return nullptr;
}

std::vector<std::string> builtin_reduction_kinds() { return {}; }

}  // namespace acs
