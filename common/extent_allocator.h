// ztier common: a free-extent allocator over [0, units) in caller-chosen
// units (stripe units of a swap file, pages of a pinned DRAM region).
// First fit over a map of free runs, coalescing on free.
// Not thread-safe: callers hold their own lock around every call.
#ifndef ZTIER_COMMON_EXTENT_ALLOCATOR_H_
#define ZTIER_COMMON_EXTENT_ALLOCATOR_H_

#include <cstdint>
#include <iterator>
#include <map>
#include <vector>

namespace ztier {

struct Extent {
  uint64_t start;  // in units
  uint64_t count;
};

class ExtentAllocator {
 public:
  explicit ExtentAllocator(uint64_t units) : total_(units), free_(units) {
    if (units > 0) runs_[0] = units;
  }

  uint64_t total_units() const { return total_; }
  uint64_t free_units() const { return free_; }

  // `count` units as few extents as first fit gives; empty if not enough free.
  std::vector<Extent> Allocate(uint64_t count) {
    std::vector<Extent> out;
    if (count == 0 || count > free_) return out;
    // Prefer one run that holds everything; else take runs in order.
    for (auto it = runs_.begin(); it != runs_.end(); ++it) {
      if (it->second >= count) {
        out.push_back(Take(it, count));
        return out;
      }
    }
    uint64_t need = count;
    while (need > 0) {
      auto it = runs_.begin();
      const uint64_t n = std::min(need, it->second);
      out.push_back(Take(it, n));
      need -= n;
    }
    return out;
  }

  // One run of `count` units (first fit); false if no free run is that long.
  bool AllocateContiguous(uint64_t count, uint64_t* start) {
    if (count == 0) return false;
    for (auto it = runs_.begin(); it != runs_.end(); ++it) {
      if (it->second >= count) {
        *start = Take(it, count).start;
        return true;
      }
    }
    return false;
  }

  // Extends the range to [0, units) (units >= total_units()); the new units
  // are free and join a free run that ends at the old end.
  void Grow(uint64_t units) {
    if (units <= total_) return;
    uint64_t start = total_, count = units - total_;
    if (!runs_.empty()) {
      auto last = std::prev(runs_.end());
      if (last->first + last->second == total_) {
        start = last->first;
        count += last->second;
        runs_.erase(last);
      }
    }
    runs_[start] = count;
    free_ += units - total_;
    total_ = units;
  }

  // Cuts the range back to [0, units) (units <= total_units()); false (and
  // no change) unless every unit past `units` is free.
  [[nodiscard]] bool Shrink(uint64_t units) {
    if (units >= total_) return units == total_;
    if (runs_.empty()) return false;
    auto last = std::prev(runs_.end());
    if (last->first > units || last->first + last->second != total_) return false;
    if (last->first == units) {
      runs_.erase(last);
    } else {
      last->second = units - last->first;
    }
    free_ -= total_ - units;
    total_ = units;
    return true;
  }

  // Marks [start, start+count) used; false if any unit of it is not free.
  bool Reserve(uint64_t start, uint64_t count) {
    auto it = runs_.upper_bound(start);
    if (it == runs_.begin()) return false;
    --it;
    const uint64_t run_start = it->first, run_count = it->second;
    if (start + count > run_start + run_count) return false;
    runs_.erase(it);
    if (start > run_start) runs_[run_start] = start - run_start;
    if (start + count < run_start + run_count) {
      runs_[start + count] = run_start + run_count - (start + count);
    }
    free_ -= count;
    return true;
  }

  // Returns [start, start+count) to the free runs; false (and no change) if
  // any unit of it is already free (a double free) or it is out of range.
  [[nodiscard]] bool Free(uint64_t start, uint64_t count) {
    if (start + count > total_ || start + count < start) return false;
    auto next = runs_.lower_bound(start);
    if (next != runs_.end() && next->first < start + count) return false;
    if (next != runs_.begin()) {
      auto before = std::prev(next);
      if (before->first + before->second > start) return false;
    }
    free_ += count;
    if (next != runs_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        count += prev->second;
        runs_.erase(prev);
      }
    }
    if (next != runs_.end() && start + count == next->first) {
      count += next->second;
      runs_.erase(next);
    }
    runs_[start] = count;
    return true;
  }

 private:
  Extent Take(std::map<uint64_t, uint64_t>::iterator it, uint64_t n) {
    const Extent e{it->first, n};
    const uint64_t rest = it->second - n;
    runs_.erase(it);
    if (rest > 0) runs_[e.start + n] = rest;
    free_ -= n;
    return e;
  }

  uint64_t total_;
  uint64_t free_;
  std::map<uint64_t, uint64_t> runs_;  // start -> count
};

}  // namespace ztier

#endif  // ZTIER_COMMON_EXTENT_ALLOCATOR_H_
