#include "controller/rank_logs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/fd_io.h"

namespace jaxtrain::controller {
namespace {

// The errno's kind (ErrnoCode), and kResourceExhausted when the process is out of descriptors.
Status LogError(const std::string& what, int err) {
  const StatusCode code =
      err == EMFILE || err == ENFILE ? StatusCode::kResourceExhausted : ErrnoCode(err);
  return {code, what + ": " + std::strerror(err)};
}

}  // namespace

RankLogs::RankLogs(std::function<std::string(int)> path, int world_size)
    : path_(std::move(path)),
      fds_(static_cast<size_t>(world_size), -1),
      headed_(static_cast<size_t>(world_size), -1),
      open_line_(static_cast<size_t>(world_size), 0) {}

RankLogs::~RankLogs() { CloseAll(); }

void RankLogs::set_max_open(size_t n) {
  max_open_ = std::max<size_t>(n, 1);
  while (open_.size() > max_open_) CloseOldest();
}

void RankLogs::CloseOldest() {
  close(fds_[static_cast<size_t>(open_.front())]);
  fds_[static_cast<size_t>(open_.front())] = -1;
  open_.pop_front();
}

void RankLogs::CloseAll() {
  while (!open_.empty()) CloseOldest();
}

Status RankLogs::Write(int rank, std::string_view text) {
  const auto r = static_cast<size_t>(rank);
  if (fds_[r] < 0) {
    if (open_.size() >= max_open_) CloseOldest();
    const std::string path = path_(rank);
    int fd;
    // Out of descriptors (the budget is a guess: other parts of the process hold some too):
    // close the log opened longest ago and try again, until this one is the only one left.
    // Read-write to see its last byte (an earlier driver's, or before CloseOldest()).
    while ((fd = open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0 &&
           (errno == EMFILE || errno == ENFILE) && !open_.empty()) {
      CloseOldest();
    }
    if (fd < 0) return LogError("cannot open " + path, errno);
    fds_[r] = fd;
    open_.push_back(rank);
    struct stat st;
    char last = '\n';
    if (fstat(fd, &st) == 0 && st.st_size > 0 && pread(fd, &last, 1, st.st_size - 1) != 1) {
      last = '\n';
    }
    open_line_[r] = last != '\n';
  }
  int err = 0;
  if (headed_[r] != attempt_) {
    std::string headers = open_line_[r] ? "\n" : "";
    for (int a = std::max(headed_[r] + 1, std::max(first_attempt_, 0)); a <= attempt_; ++a) {
      headers += "===== jaxtrain: attempt " + std::to_string(a) + " =====\n";
    }
    if (!WriteAll(fds_[r], headers, "write", &err).ok()) {
      return LogError("cannot write " + path_(rank), err);
    }
    headed_[r] = attempt_;
    open_line_[r] = 0;
  }
  if (!WriteAll(fds_[r], text, "write", &err).ok()) {
    return LogError("cannot write " + path_(rank), err);
  }
  if (!text.empty()) open_line_[r] = text.back() != '\n';
  return OkStatus();
}

Status RankLogs::HeadAll() {
  Status first = OkStatus();
  for (size_t r = 0; r < headed_.size(); ++r) {
    if (headed_[r] == attempt_) continue;
    Status s = Write(static_cast<int>(r), "");
    if (first.ok()) first = s;
  }
  return first;
}

}  // namespace jaxtrain::controller
