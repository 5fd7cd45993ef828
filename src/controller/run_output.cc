#include "controller/run_output.h"

#include <sys/ioctl.h>

#include <utility>

namespace jaxtrain::controller {

size_t TerminalWidth(int fd) {
  winsize ws{};
  if (ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 100;
}

RunOutput::RunOutput(int console_fd, bool status_line, std::function<std::string(int)> log_path,
                     int world_size, int stderr_fd)
    : console_fd_(console_fd),
      status_line_(status_line),
      stderr_fd_(stderr_fd),
      logs_(std::move(log_path), world_size) {}

void RunOutput::Say(const std::string& line) {
  std::string text = "jaxtrain: " + line + "\n";
  if (!status_.empty()) console_.Write(console_fd_, kEraseLine);
  console_.Write(stderr_fd_, std::move(text));
  if (!status_.empty()) console_.Write(console_fd_, status_);
}

void RunOutput::ToConsole(std::string text) {
  if (console_fd_ < 0 || text.empty()) return;
  if (!status_.empty()) text = kEraseLine + text + status_;
  console_.Write(console_fd_, std::move(text));
}

void RunOutput::ShowStatus(const StatusView& view) {
  if (!status_line_ || console_fd_ < 0) return;
  std::string line = FormatStatus(view, TerminalWidth(console_fd_) - 1);
  if (line == status_) return;
  status_ = std::move(line);
  console_.Write(console_fd_, kEraseLine + status_);
}

void RunOutput::ClearStatus() {
  if (status_.empty()) return;
  console_.Write(console_fd_, kEraseLine);
  status_.clear();
}

std::string RunOutput::WriteLog(int rank, std::string_view text) {
  return WarnLogs(logs_.Write(rank, text));
}

std::string RunOutput::CloseLogs() {
  std::string warning = WarnLogs(logs_.HeadAll());
  logs_.CloseAll();
  return warning;
}

std::string RunOutput::WarnLogs(const Status& s) {
  if (s.ok() || log_failed_) return "";
  log_failed_ = true;
  Say("warning: " + s.message() + "; rank output is missing from the logs from here on");
  return s.message();
}

}  // namespace jaxtrain::controller
