#include "storage/filesystem.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <memory>

#include "storage/checkpoint.h"
#include "storage/files.h"

namespace jaxtrain::storage {
namespace {

class PosixFileSystem final : public FileSystem {
 public:
  StatusOr<FileInfo> Stat(const std::string& path) override {
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) return PathError("cannot stat", path, errno);
    FileInfo info{.size = static_cast<uint64_t>(st.st_size),
                  .mode = static_cast<uint32_t>(st.st_mode & 0777)};
    if (S_ISREG(st.st_mode)) info.kind = FileInfo::Kind::kFile;
    if (S_ISDIR(st.st_mode)) info.kind = FileInfo::Kind::kDirectory;
    if (S_ISLNK(st.st_mode)) info.kind = FileInfo::Kind::kLink;
    return info;
  }

  StatusOr<bool> MakeDir(const std::string& path, uint32_t mode) override {
    if (mkdir(path.c_str(), static_cast<mode_t>(mode)) == 0) return true;
    const int err = errno;
    struct stat st;
    if (err == EEXIST && lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return false;
    return PathError("cannot create directory", path, err);
  }

  Status MakeDirs(const std::string& path) override { return storage::MakeDirs(path); }

  Status Fsync(const std::string& path, bool directory) override {
    int fd = open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) return PathError("cannot open", path, errno);
    Status s = fsync(fd) == 0 ? OkStatus() : PathError("cannot fsync", path, errno);
    close(fd);
    return s;
  }

  Status Rename(const std::string& from, const std::string& to) override {
    if (rename(from.c_str(), to.c_str()) != 0) return PathError("cannot move", from, errno);
    return OkStatus();
  }

  Status Exchange(const std::string& a, const std::string& b) override {
    if (renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) {
      return PathError("cannot exchange with", b, errno);
    }
    return OkStatus();
  }

  Status WriteFileAtomically(const std::string& path, std::string_view contents) override {
    return storage::WriteFileAtomically(path, contents);
  }

  StatusOr<std::string> ReadFile(const std::string& path) override {
    return storage::ReadFile(path);
  }

  StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    std::unique_ptr<DIR, int (*)(DIR*)> d(opendir(dir.c_str()), closedir);
    if (!d) return PathError("cannot list", dir, errno);
    std::vector<std::string> names;
    while (dirent* e = readdir(d.get())) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(std::move(name));
    }
    return names;
  }

  Status RemoveTree(const std::string& path) override { return storage::RemoveTree(path); }
};

}  // namespace

FileSystem& LocalFileSystem() {
  static PosixFileSystem* fs = new PosixFileSystem;
  return *fs;
}

}  // namespace jaxtrain::storage
