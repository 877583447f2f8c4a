#pragma once

#include <string>

namespace attnserve::test {

// A fresh private directory under TMPDIR (or /tmp), named attnserve-TAG-XXXXXX, for the files
// one test writes. Every directory made is removed, with what it holds, when the process exits
// normally: test runs leave nothing behind.
std::string MakeTempDir(const std::string& tag);

}  // namespace attnserve::test
