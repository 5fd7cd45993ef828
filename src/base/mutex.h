// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable_any with clang's
// thread-safety annotations, so that GUARDED_BY fields are checked by -Wthread-safety (the build
// turns it on under clang; the annotations compile to nothing elsewhere).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define JT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define JT_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) JT_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY JT_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) JT_THREAD_ANNOTATION(guarded_by(x))
#define REQUIRES(...) JT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) JT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) JT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define EXCLUDES(...) JT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))

namespace jaxtrain {

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// Waits release `mu` while they block and hold it again when they return.
class CondVar {
 public:
  template <typename Predicate>
  void Wait(Mutex& mu, Predicate done) REQUIRES(mu) {
    cv_.wait(mu, done);
  }
  // False when `timeout` passed with `done` still false.
  template <typename Rep, typename Period, typename Predicate>
  bool WaitFor(Mutex& mu, std::chrono::duration<Rep, Period> timeout, Predicate done) REQUIRES(mu) {
    return cv_.wait_for(mu, timeout, done);
  }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable_any cv_;
};

}  // namespace jaxtrain
