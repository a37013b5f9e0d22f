#include "stoker/io/thread_pool.hpp"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <system_error>

namespace stoker::io {

ThreadPool::ThreadPool(size_t num_threads)
    : num_threads_(num_threads == 0 ? default_size() : num_threads) {}

ThreadPool::~ThreadPool() {
  std::deque<std::function<void()>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

size_t ThreadPool::default_size() {
  // The cores this process may run on (a container's cpuset), not the machine's.
  size_t cores = std::thread::hardware_concurrency();
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cores = CPU_COUNT(&set);
  return std::clamp<size_t>(cores, 2, 64);
}

void ThreadPool::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (workers_.empty()) {
      workers_.reserve(num_threads_);
      for (size_t i = 0; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
    }
    queue_.push_back(std::move(task));
  }
  wake_.notify_one();
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // tasks catch their own errors; see ShardReader
  }
}

void parallel_for(size_t n, size_t num_threads, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  size_t count = std::min(std::max<size_t>(num_threads, 1), n);
  std::vector<std::thread> threads;
  for (size_t t = 1; t < count; ++t) {
    try {
      threads.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // out of threads (a pids limit): the ones running share the rest
    }
  }
  work();
  for (auto& thread : threads) thread.join();
}

}  // namespace stoker::io
