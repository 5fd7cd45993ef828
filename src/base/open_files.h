// The process's limit on open file descriptors (RLIMIT_NOFILE), raised for runs with many ranks:
// the controller holds a connection and a log file per rank, so 16,384 ranks need over 32,768
// descriptors where the usual soft limit is 1,024.
#pragma once

#include <cstdint>

#include "base/status.h"

namespace jaxtrain {

// Raises the soft RLIMIT_NOFILE towards `wanted` descriptors, as far as the hard limit allows, and
// the hard limit too when the process may (CAP_SYS_RESOURCE). Never lowers a limit.
// Errors: kResourceExhausted when the soft limit ends below `needed` (<= wanted); the message
// names RLIMIT_NOFILE, its value, the need, and what to do (ulimit -n, or the service's
// LimitNOFILE).
Status RaiseOpenFileLimit(uint64_t needed, uint64_t wanted);

}  // namespace jaxtrain
