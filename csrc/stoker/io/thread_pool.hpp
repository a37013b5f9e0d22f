// A fixed pool of worker threads with one FIFO queue. Threads start lazily on
// the first submit, so building a reader in a process that then forks costs
// nothing; the owner (ShardReader) replaces the pool after a fork.
#pragma once

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

  // A default size from the machine: one thread per core, at least two.
  static size_t default_size();

 private:
  void worker_loop();

  size_t num_threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
};

}  // namespace stoker::io
