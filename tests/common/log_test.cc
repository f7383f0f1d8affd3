// Tests of logging's environment: a ZTIER_LOG_SUBSYS name that no line
// carries (a typo) hid every line, warnings included, without a word; it is
// now warned of, naming the subsystems there are. Each case runs in a fresh
// process (the configuration is read once), its stderr in a file.
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/log.h"
#include "tests/testing/spawn_self.h"

namespace ztier {
namespace {

TEST(LogChild, WritesALineOfTwoSubsystems) {
  const char* out = std::getenv("ZTIER_LOG_TEST_OUT");
  if (out == nullptr) GTEST_SKIP() << "run by LogTest.UnknownSubsystemsAreWarnedOf";
  const int fd = ::open(out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::dup2(fd, STDERR_FILENO), STDERR_FILENO);
  ZT_LOG(kWarn, "nvme") << "a line of nvme";
  ZT_LOG(kWarn, "engine") << "a line of engine";
}

std::string LogOf(const std::string& subsys) {
  const std::string out = (std::filesystem::temp_directory_path() /
                           ("ztier-log-test-" + std::to_string(::getpid()) + ".txt"))
                              .string();
  Result<pid_t> pid = testing::SpawnSelf(
      "LogChild.WritesALineOfTwoSubsystems",
      {"ZTIER_LOG_TEST_OUT=" + out, "ZTIER_LOG=warn", "ZTIER_LOG_SUBSYS=" + subsys});
  EXPECT_TRUE(pid.ok()) << pid.status();
  if (!pid.ok()) return "";
  Result<int> rc = testing::WaitChild(*pid);
  EXPECT_TRUE(rc.ok() && *rc == 0) << (rc.ok() ? std::to_string(*rc) : rc.status().ToString());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove(out);
  return text.str();
}

TEST(LogTest, UnknownSubsystemsAreWarnedOf) {
  std::string text = LogOf("nvm");
  EXPECT_NE(text.find("ZTIER_LOG_SUBSYS names 'nvm', which nothing logs as (the names: "
                      "checkpoint, client, cpu_adam, engine, nvme"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("a line of"), std::string::npos) << text;
  text = LogOf("nvme,bogus");
  EXPECT_NE(text.find("names 'bogus'"), std::string::npos) << text;
  EXPECT_NE(text.find("a line of nvme"), std::string::npos) << text;
  EXPECT_EQ(text.find("a line of engine"), std::string::npos) << text;
  text = LogOf("engine,nvme");
  EXPECT_EQ(text.find("ZTIER_LOG_SUBSYS names"), std::string::npos) << text;
  EXPECT_NE(text.find("a line of engine"), std::string::npos) << text;
}

}  // namespace
}  // namespace ztier

namespace ztier {
namespace {

// A line others can make repeat at will is logged `burst` times, then
// `burst` a period; the lines left out are said with the next one.
// ZTIER_LOG=INFO was refused ("not error, warn, info or debug") where the
// settings' words are taken in any case.
TEST(LogTest, LevelsAreReadInAnyCase) {
  EXPECT_EQ(ParseLogLevel("INFO"), LogLevel::kInfo);
  EXPECT_EQ(ParseLogLevel("Debug"), LogLevel::kDebug);
  EXPECT_EQ(ParseLogLevel("warn"), LogLevel::kWarn);
  EXPECT_EQ(ParseLogLevel("error"), LogLevel::kError);
  EXPECT_EQ(ParseLogLevel("warning"), std::nullopt);
  EXPECT_EQ(ParseLogLevel(""), std::nullopt);
}

TEST(LogRateTest, ABurstThenTheRestCountedAndSaidWithTheNextLine) {
  LogRate rate(3, std::chrono::milliseconds(200));
  std::string note = "x";
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(rate.Allow(&note)) << k;
    EXPECT_EQ(note, "");
  }
  for (int k = 0; k < 5; ++k) EXPECT_FALSE(rate.Allow(&note)) << k;
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // 2.25 lines' worth
  ASSERT_TRUE(rate.Allow(&note));
  EXPECT_EQ(note, " (5 more like it not logged)");
  ASSERT_TRUE(rate.Allow(&note));
  EXPECT_EQ(note, "");
}

}  // namespace
}  // namespace ztier
