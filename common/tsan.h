// ztier common: happens-before edges for ThreadSanitizer where the library
// that makes them is not instrumented.
//
// Debian's oneTBB is built without -fsanitize=thread: a parallel_for hands
// its body to worker threads, and back to the caller, through atomics TSan
// cannot see, so every write a task makes and the caller reads after the
// join (and every write the caller made before the loop and a task reads)
// looks like a race. Code that fans out through oneTBB states those two
// edges itself:
//
//   TsanEdge start, done;
//   start.Release();                      // the caller's writes so far...
//   parallel_for(..., [&](range) {
//     start.Acquire();                    // ...are seen by every task
//     Work(range);
//     done.Release();                     // each task's writes...
//   });
//   done.Acquire();                       // ...are seen by the caller
//
// so that TSan reports only races the code makes, not ones the library
// hides. Outside a TSan build every call is empty and inlined away.
//
// Thread safety: Release and Acquire may be called from any thread at once
// (TSan's own annotations are). Failure: none.
#ifndef ZTIER_COMMON_TSAN_H_
#define ZTIER_COMMON_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#define ZTIER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ZTIER_TSAN 1
#endif
#endif

#ifdef ZTIER_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace ztier {

// One synchronization point: Release() joins the calling thread's history
// into it, Acquire() makes everything released into it so far happen before
// the caller's next action.
class TsanEdge {
 public:
  void Release() {
#ifdef ZTIER_TSAN
    __tsan_release(this);
#endif
  }
  void Acquire() {
#ifdef ZTIER_TSAN
    __tsan_acquire(this);
#endif
  }

 private:
  [[maybe_unused]] char byte_ = 0;  // an address of its own
};

}  // namespace ztier

#endif  // ZTIER_COMMON_TSAN_H_
