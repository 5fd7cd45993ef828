// SettledState: what became of a process that was sent SIGKILL, for tests.
//
// A signal reaches its process on the process's own schedule: right after kill() returns, the
// target may still show "R" while the kernel ends it. SettledState reads /proc/PID/stat until the
// process is gone ("") or a zombie ("Z"), for at most `timeout_ms`, and returns the last state it
// read (another letter: the process is still there).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace jaxtrain::launch::testing {

inline std::string SettledState(pid_t pid, int timeout_ms = 10'000) {
  std::string state;
  for (int waited = 0;; waited += 10) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string id, name;
    state.clear();
    stat >> id >> name >> state;  // the name of a test's child has no spaces
    if (state.empty() || state == "Z" || waited >= timeout_ms) return state;
    usleep(10'000);
  }
}

}  // namespace jaxtrain::launch::testing
