// FaultInjectingFileSystem: the local filesystem, stopped at the Nth operation, for crash tests.
//
// Every call counts as one operation. With CrashAt(n), operations 0..n-1 are done on the local
// filesystem and operation n and every later one do nothing and fail with kUnavailable, as if the
// process had been killed just before operation n: what the earlier ones wrote stays, in the
// state a crash would leave it (each of them is durable or atomic on its own). Without CrashAt it
// only counts, so a test can learn how many operations a commit performs.
//
// Thread-safety: one thread at a time (the counters are not shared safely).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "storage/filesystem.h"

namespace jaxtrain::storage::testing {

class FaultInjectingFileSystem final : public FileSystem {
 public:
  void CrashAt(uint64_t operation) { crash_at_ = operation; }
  uint64_t operations() const { return operations_; }
  bool crashed() const { return operations_ > crash_at_; }
  // The operations done so far, one line each ("rename a -> b"), for a failing test's message.
  const std::vector<std::string>& log() const { return log_; }

  StatusOr<FileInfo> Stat(const std::string& path) override {
    JT_RETURN_IF_ERROR(Step("stat " + path));
    return LocalFileSystem().Stat(path);
  }
  StatusOr<bool> MakeDir(const std::string& path, uint32_t mode) override {
    JT_RETURN_IF_ERROR(Step("mkdir " + path));
    return LocalFileSystem().MakeDir(path, mode);
  }
  Status MakeDirs(const std::string& path) override {
    JT_RETURN_IF_ERROR(Step("mkdir -p " + path));
    return LocalFileSystem().MakeDirs(path);
  }
  Status Fsync(const std::string& path, bool directory) override {
    JT_RETURN_IF_ERROR(Step("fsync " + path));
    return LocalFileSystem().Fsync(path, directory);
  }
  Status Rename(const std::string& from, const std::string& to) override {
    JT_RETURN_IF_ERROR(Step("rename " + from + " -> " + to));
    return LocalFileSystem().Rename(from, to);
  }
  Status Exchange(const std::string& a, const std::string& b) override {
    JT_RETURN_IF_ERROR(Step("exchange " + a + " <-> " + b));
    return LocalFileSystem().Exchange(a, b);
  }
  Status WriteFileAtomically(const std::string& path, std::string_view contents) override {
    JT_RETURN_IF_ERROR(Step("write " + path));
    return LocalFileSystem().WriteFileAtomically(path, contents);
  }
  StatusOr<std::string> ReadFile(const std::string& path) override {
    JT_RETURN_IF_ERROR(Step("read " + path));
    return LocalFileSystem().ReadFile(path);
  }
  StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    JT_RETURN_IF_ERROR(Step("list " + dir));
    return LocalFileSystem().List(dir);
  }
  Status RemoveTree(const std::string& path) override {
    JT_RETURN_IF_ERROR(Step("remove " + path));
    return LocalFileSystem().RemoveTree(path);
  }

 private:
  Status Step(std::string what) {
    const uint64_t n = operations_++;
    if (n >= crash_at_) {
      return UnavailableError("injected crash at operation " + std::to_string(n) + " (" + what +
                              ")");
    }
    log_.push_back(std::move(what));
    return OkStatus();
  }

  uint64_t crash_at_ = std::numeric_limits<uint64_t>::max();
  uint64_t operations_ = 0;
  std::vector<std::string> log_;
};

}  // namespace jaxtrain::storage::testing
