#include "base/fd_io.h"

#include <unistd.h>

#include <cerrno>

namespace jaxtrain {

Status WriteAll(int fd, std::string_view data, std::string_view what, int* err) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = n < 0 ? errno : EIO;
      if (err != nullptr) *err = e;
      return ErrnoError(what, e);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return OkStatus();
}

StatusOr<std::string> ReadAll(int fd, std::string_view what) {
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(what, errno);
    if (n == 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace jaxtrain
