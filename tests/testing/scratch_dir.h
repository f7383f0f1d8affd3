// Test support: a scratch directory under the test's working directory (the
// build tree, a real filesystem, so O_DIRECT swap files work there, which a
// tmpfs /tmp would refuse), named after the tag, the process and the running
// test, and removed with everything in it on destruction.
#ifndef ZTIER_TESTS_TESTING_SCRATCH_DIR_H_
#define ZTIER_TESTS_TESTING_SCRATCH_DIR_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include "common/status.h"

namespace ztier::testing {

class ScratchDir {
 public:
  explicit ScratchDir(std::string_view tag) {
    const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
    // Parameterised test names hold '/': one flat directory, not a nest
    // whose parent would stay behind.
    std::string name = test != nullptr ? test->name() : "";
    std::replace(name.begin(), name.end(), '/', '_');
    path_ =
        std::filesystem::current_path() / StrCat("ztier-test-", tag, "-", ::getpid(), "-", name);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string path() const { return path_.string(); }
  // The path of `name` inside (not created).
  std::string operator/(std::string_view name) const { return (path_ / name).string(); }
  // A directory `name` inside, created.
  std::string sub(std::string_view name) const {
    const std::filesystem::path p = path_ / name;
    std::filesystem::create_directories(p);
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_SCRATCH_DIR_H_
