// A fixed pool of worker threads with one FIFO queue. Threads start lazily on
// the first submit, so building a reader in a process that then forks costs
// nothing; the owner (ShardReader) replaces the pool after a fork.
// Destroying the pool drops the tasks still queued and waits only for the
// running ones, which should watch stopping() to return early.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace stoker::io {

class ThreadPool {
 public:
  explicit ThreadPool(size_t num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void submit(std::function<void()> task);
  size_t num_threads() const { return num_threads_; }
  const std::atomic<bool>& stopping() const { return stopping_; }

  // A default size from the machine: one thread per core, at least two.
  static size_t default_size();

 private:
  void worker_loop();

  size_t num_threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> workers_;
  std::atomic<bool> stopping_{false};
};

// Runs fn(i) for i in [0, n) on up to `num_threads` short-lived threads (the
// caller's among them) and returns when all are done. For one-off work such
// as indexing: it leaves no threads behind, so it is safe around fork().
// fn must not throw.
void parallel_for(size_t n, size_t num_threads, const std::function<void(size_t)>& fn);

}  // namespace stoker::io
