// Whole reads and writes on file descriptors, retried on EINTR and on short transfers.
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"

namespace jaxtrain {

// Writes all of `data` to `fd` (blocking fds). Errors: kInternal naming `what` and errno's text
// (EPIPE when the reader is gone, ENOSPC, EIO, ...); the error's errno is in `*err` if given.
Status WriteAll(int fd, std::string_view data, std::string_view what = "write", int* err = nullptr);

// Reads `fd` until end of file. Errors: kInternal naming `what` and errno's text.
StatusOr<std::string> ReadAll(int fd, std::string_view what = "read");

}  // namespace jaxtrain
