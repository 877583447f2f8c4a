#include "tests/common/temp_dir.h"

#include <stdlib.h>

#include <filesystem>
#include <mutex>
#include <system_error>
#include <vector>

namespace attnserve::test {
namespace {

// Removes the directories at exit. A forked child that ends with _exit (the only kind the tests
// make) runs no destructors, so it cannot remove its parent's files.
class Made {
 public:
  ~Made() {
    std::error_code ignored;
    for (const std::string& dir : dirs_) std::filesystem::remove_all(dir, ignored);
  }
  void Add(std::string dir) {
    std::lock_guard lock(mu_);
    dirs_.push_back(std::move(dir));
  }

 private:
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

}  // namespace

std::string MakeTempDir(const std::string& tag) {
  static Made made;
  std::error_code error;
  std::filesystem::path base = std::filesystem::temp_directory_path(error);
  if (error) base = "/tmp";
  std::string pattern = (base / ("attnserve-" + tag + "-XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) return base.string();
  made.Add(pattern);
  return pattern;
}

}  // namespace attnserve::test
