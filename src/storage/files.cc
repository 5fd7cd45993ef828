#include "storage/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/fd_io.h"

namespace jaxtrain::storage {

Status PathError(std::string_view what, const std::string& path, int err) {
  return {ErrnoCode(err), std::string(what) + " '" + path + "': " + std::strerror(err)};
}

namespace {

// Makes the entries of `dir` (a new or renamed file or directory) durable.
Status FsyncDir(const std::string& dir) {
  const std::string path = dir.empty() ? "." : dir;
  int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return PathError("cannot open directory", path, errno);
  Status s;
  if (fsync(fd) != 0 && errno != EINVAL) s = PathError("cannot fsync directory", path, errno);
  close(fd);
  return s;
}

std::string ParentDir(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

Status WriteFd(int fd, std::string_view data, const std::string& path) {
  int err = 0;
  if (WriteAll(fd, data, "write", &err).ok()) return OkStatus();
  return PathError("cannot write", path, err);
}

std::string JoinPath(std::string_view a, std::string_view b) {
  std::string out(a);
  if (!out.empty() && out.back() != '/') out.push_back('/');
  out.append(b);
  return out;
}

Status MakeDirs(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("empty directory path");
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    std::string prefix = path.substr(0, pos);
    if (mkdir(prefix.c_str(), 0755) == 0) {
      // A new directory survives a crash only once its parent's entry is on disk.
      JT_RETURN_IF_ERROR(FsyncDir(ParentDir(prefix)));
    } else if (errno != EEXIST) {
      return PathError("cannot create directory", prefix, errno);
    }
    struct stat st;
    if (stat(prefix.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
      return FailedPreconditionError("cannot create directory '" + path + "': '" + prefix +
                                     "' is a file, not a directory");
    }
  }
  return OkStatus();
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return PathError("cannot create", tmp, errno);
  Status s = WriteFd(fd, contents, tmp);
  if (s.ok() && fsync(fd) != 0) s = PathError("cannot fsync", tmp, errno);
  close(fd);
  if (s.ok() && rename(tmp.c_str(), path.c_str()) != 0)
    s = PathError("cannot rename to", path, errno);
  if (!s.ok()) {
    unlink(tmp.c_str());
    return s;
  }
  // The rename is durable only once the directory is.
  return FsyncDir(ParentDir(path));
}

Status AppendToFile(const std::string& path, std::string_view contents) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return PathError("cannot open", path, errno);
  struct stat st;
  const off_t before = fstat(fd, &st) == 0 ? st.st_size : -1;
  Status s = WriteFd(fd, contents, path);
  // A short write (a full disk) would leave a torn line that the next append continues.
  if (!s.ok() && before >= 0 && ftruncate(fd, before) != 0) {
    s = Status(s.code(), s.message() + "; its last line may be torn (cannot truncate it: " +
                             std::strerror(errno) + ")");
  }
  close(fd);
  return s;
}

Status TruncateFile(const std::string& path, uint64_t size) {
  if (truncate(path.c_str(), static_cast<off_t>(size)) != 0) {
    return PathError("cannot truncate", path, errno);
  }
  return OkStatus();
}

uint64_t FileSize(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PathError("cannot open", path, errno);
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      close(fd);
      return PathError("cannot read", path, err);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

std::string TailOfFile(const std::string& path, size_t max_bytes) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  off_t size = lseek(fd, 0, SEEK_END);
  off_t start = size > static_cast<off_t>(max_bytes) ? size - static_cast<off_t>(max_bytes) : 0;
  std::string out(static_cast<size_t>(size - start), '\0');
  ssize_t n = pread(fd, out.data(), out.size(), start);
  close(fd);
  out.resize(n > 0 ? static_cast<size_t>(n) : 0);
  if (start > 0) {
    size_t nl = out.find('\n');
    if (nl != std::string::npos) out.erase(0, nl + 1);
  }
  return out;
}

}  // namespace jaxtrain::storage
