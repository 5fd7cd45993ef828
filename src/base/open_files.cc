#include "base/open_files.h"

#include <sys/resource.h>

#include <algorithm>
#include <string>

namespace jaxtrain {

Status RaiseOpenFileLimit(uint64_t needed, uint64_t wanted) {
  wanted = std::max(needed, wanted);
  rlimit now{};
  if (getrlimit(RLIMIT_NOFILE, &now) != 0) return ErrnoError("getrlimit(RLIMIT_NOFILE)", errno);
  if (now.rlim_cur >= wanted) return OkStatus();
  rlimit raised = now;
  raised.rlim_cur = wanted;
  raised.rlim_max = std::max<rlim_t>(now.rlim_max, wanted);
  if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {  // above the hard limit: needs CAP_SYS_RESOURCE
    raised.rlim_cur = std::min<rlim_t>(wanted, now.rlim_max);
    raised.rlim_max = now.rlim_max;
    if (raised.rlim_cur > now.rlim_cur && setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      raised.rlim_cur = now.rlim_cur;
    }
  }
  getrlimit(RLIMIT_NOFILE, &now);
  if (now.rlim_cur >= needed) return OkStatus();
  return ResourceExhaustedError(
      "this process may open at most " + std::to_string(now.rlim_cur) +
      " files (RLIMIT_NOFILE, hard limit " + std::to_string(now.rlim_max) + "), and " +
      std::to_string(needed) +
      " are needed; raise it (ulimit -n, or LimitNOFILE= for a service) or use fewer ranks");
}

}  // namespace jaxtrain
