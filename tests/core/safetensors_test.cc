// Tests of the safetensors reader: every dtype it converts, and every refusal. The bad files are
// built here, in a temp dir, by corrupting one piece of a good one.
#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/common/safetensors_writer.h"
#include "tests/common/temp_dir.h"

namespace attnserve::core {
namespace {

using test::MakeSafetensors;
using test::MakeTempDir;
using test::SafetensorsParts;
using test::TensorToWrite;
using test::WriteBytes;
using test::WriteSafetensorsFile;

TensorToWrite F32(const std::string& name, std::vector<int64_t> shape, std::vector<float> values) {
  TensorToWrite t;
  t.name = name;
  t.shape = std::move(shape);
  t.values = std::move(values);
  return t;
}

// A tensor whose bytes are given exactly (to test conversions independently of our writer).
TensorToWrite Raw(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                  const std::vector<uint16_t>& bits) {
  TensorToWrite t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  for (uint16_t b : bits) {
    t.raw.push_back(static_cast<char>(b & 0xff));
    t.raw.push_back(static_cast<char>(b >> 8));
  }
  return t;
}

class SafetensorsTest : public testing::Test {
 protected:
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Writes `parts` (with an honest or a given header length) and reads it back.
  absl::StatusOr<SafetensorsFile> WriteAndRead(const SafetensorsParts& parts,
                                               int64_t header_length = -1) {
    const std::string path = Path("file.safetensors");
    WriteSafetensorsFile(path, parts, header_length);
    return ReadSafetensors(path);
  }

  // A header given as text over `data_bytes` zero bytes of data.
  absl::StatusOr<SafetensorsFile> ReadHeader(const std::string& header, size_t data_bytes = 8) {
    return WriteAndRead({header, std::string(data_bytes, '\0')});
  }

  const std::string dir_ = MakeTempDir("safetensors");
};

TEST_F(SafetensorsTest, ReadsF32TensorsAndMetadata) {
  auto file = WriteAndRead(
      MakeSafetensors({F32("a", {2, 2}, {1, 2, 3, 4}), F32("b", {1}, {-5})}, {{"num_heads", "3"}}));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata.at("num_heads"), "3");
  EXPECT_EQ(file->tensors.at("a").dtype, "F32");
  EXPECT_EQ(file->tensors.at("a").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(file->tensors.at("a").values, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(file->tensors.at("b").values, (std::vector<float>{-5}));
}

TEST_F(SafetensorsTest, ReadsEmptyAndZeroSizedTensors) {
  auto file = WriteAndRead(MakeSafetensors({F32("empty", {0, 3}, {}), F32("s", {}, {7})}));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->tensors.at("empty").values.empty());
  EXPECT_EQ(file->tensors.at("s").values, (std::vector<float>{7}));
}

TEST_F(SafetensorsTest, ConvertsF16IncludingSubnormalsAndSpecials) {
  // Bit patterns and their exact values, from IEEE 754 binary16.
  const std::vector<uint16_t> bits = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x0400, 0x03ff,
                                      0x3555, 0x8000, 0x7c00, 0xfc00, 0x7e00};
  const std::vector<float> want = {1.0f,         -2.0f,           65504.0f, 0x1.0p-24f, 0x1.0p-14f,
                                   0x1.ff8p-15f, 0.333251953125f, -0.0f,    INFINITY,   -INFINITY};
  auto file = WriteAndRead(MakeSafetensors({Raw("h", "F16", {11}, bits)}));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<float>& got = file->tensors.at("h").values;
  ASSERT_EQ(got.size(), bits.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "bits " << bits[i];
  EXPECT_TRUE(std::signbit(got[7]));
  EXPECT_TRUE(std::isnan(got[10]));
}

TEST_F(SafetensorsTest, ConvertsBF16) {
  const std::vector<uint16_t> bits = {0x3f80, 0x4049, 0xc2f7, 0x0001, 0x7f80};
  const std::vector<float> want = {1.0f, 3.140625f, -123.5f, 0x1.0p-133f, INFINITY};
  auto file = WriteAndRead(MakeSafetensors({Raw("b", "BF16", {5}, bits)}));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->tensors.at("b").values, want);
}

// Every f16 value survives f16 -> f32 (reader) -> f16 (test writer): the two conversions agree.
TEST_F(SafetensorsTest, F16ConversionRoundTripsEveryFiniteValue) {
  std::vector<uint16_t> bits;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7c00) != 0x7c00) bits.push_back(static_cast<uint16_t>(b));
  }
  auto file =
      WriteAndRead(MakeSafetensors({Raw("all", "F16", {static_cast<int64_t>(bits.size())}, bits)}));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<float>& values = file->tensors.at("all").values;
  for (size_t i = 0; i < bits.size(); ++i) {
    ASSERT_EQ(test::FloatToHalf(values[i]), bits[i]) << "bits " << bits[i];
  }
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  EXPECT_EQ(ReadSafetensors(Path("absent.safetensors")).status().code(),
            absl::StatusCode::kNotFound);
}

// Whether this process can open `path` for reading: root (CAP_DAC_OVERRIDE) reads a file of
// mode 000 and enters a directory of mode 000, so the tests of those refusals cannot run as root.
bool CanOpen(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

bool Contains(const absl::Status& status, const std::string& text) {
  return status.message().find(text) != std::string::npos;
}

// A symlink loop is not a missing file: the message says what the system said.
TEST_F(SafetensorsTest, ASymlinkLoopSaysSo) {
  std::filesystem::create_symlink(Path("b.safetensors"), Path("a.safetensors"));
  std::filesystem::create_symlink(Path("a.safetensors"), Path("b.safetensors"));
  const absl::Status status = ReadSafetensors(Path("a.safetensors")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, "too many levels of symbolic links")) << status;
  EXPECT_TRUE(Contains(status, Path("a.safetensors"))) << status;
  EXPECT_FALSE(Contains(status, "no such file")) << status;
}

// A path through a regular file (ENOTDIR, root or not).
TEST_F(SafetensorsTest, APathThroughAFileSaysNotADirectory) {
  WriteSafetensorsFile(Path("plain"), MakeSafetensors({F32("a", {1}, {1})}));
  const std::string path = Path("plain/model.safetensors");
  const absl::Status status = ReadSafetensors(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_TRUE(Contains(status, "cannot open the file: not a directory")) << status;
  EXPECT_TRUE(Contains(status, path)) << status;
  EXPECT_FALSE(Contains(status, "no such file")) << status;
}

TEST_F(SafetensorsTest, AFileInADirectoryWeMayNotEnterSaysPermissionDenied) {
  std::filesystem::create_directory(Path("locked"));
  const std::string path = Path("locked/model.safetensors");
  WriteSafetensorsFile(path, MakeSafetensors({F32("a", {1}, {1})}));
  ASSERT_EQ(::chmod(Path("locked").c_str(), 0), 0);
  const bool bypassed = CanOpen(path);
  const absl::Status status = ReadSafetensors(path).status();
  ::chmod(Path("locked").c_str(), 0700);  // so the temp dir can be removed
  if (bypassed) GTEST_SKIP() << "this process enters a directory of mode 000 (root)";
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_TRUE(Contains(status, "permission denied")) << status;
  EXPECT_TRUE(Contains(status, path)) << status;
}

TEST_F(SafetensorsTest, AFileWeMayNotReadSaysPermissionDenied) {
  const std::string path = Path("unreadable.safetensors");
  WriteSafetensorsFile(path, MakeSafetensors({F32("a", {1}, {1})}));
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  if (CanOpen(path)) GTEST_SKIP() << "this process reads a file of mode 000 (root)";
  const absl::Status status = ReadSafetensors(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_TRUE(Contains(status, "cannot open the file: permission denied")) << status;
  EXPECT_TRUE(Contains(status, path)) << status;
}

// The same refusal as root: a write-only sysctl is a regular file that even root may not open
// for reading (procfs checks its mode without the capability), so the failed open itself is
// tested wherever the tests run.
TEST_F(SafetensorsTest, ARegularFileThatWillNotOpenSaysWhy) {
  const std::string path = "/proc/sys/vm/drop_caches";
  struct stat info;
  if (::stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode) || CanOpen(path)) {
    GTEST_SKIP() << path << " is not a regular file this process cannot open";
  }
  const absl::Status status = ReadSafetensors(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_TRUE(Contains(status, "cannot open the file: permission denied")) << status;
  EXPECT_TRUE(Contains(status, path)) << status;
}

TEST_F(SafetensorsTest, AFifoIsRefusedWithoutWaitingForAWriter) {
  const std::string path = Path("pipe.safetensors");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  std::future<absl::Status> read =
      std::async(std::launch::async, [&] { return ReadSafetensors(path).status(); });
  if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    const int writer = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);  // lets the open return
    read.wait();
    ::close(writer);
    FAIL() << "the read waited for a writer";
  }
  const absl::Status status = read.get();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, "it is not a regular file")) << status;
}

// The type is checked on what was opened, not on the path before it: a path that names a
// regular file when checked and a FIFO (renamed over it) when opened never blocks the reader.
TEST_F(SafetensorsTest, APathSwappedForAFifoNeverBlocksTheReader) {
  const std::string path = Path("swapped.safetensors");
  const SafetensorsParts parts = MakeSafetensors({F32("a", {1}, {1})});
  WriteSafetensorsFile(path, parts);
  std::atomic<bool> stop = false;
  std::thread swapper([&] {
    for (int i = 0; !stop; ++i) {
      const std::string next = Path(absl::StrCat("next", i));
      if (i % 2 == 0) {
        WriteSafetensorsFile(next, parts);
      } else if (::mkfifo(next.c_str(), 0600) != 0) {
        continue;
      }
      std::filesystem::rename(next, path);
    }
  });
  // Detached, with its state shared: blocked (the defect), it could never be joined.
  struct Reads {
    std::atomic<bool> stop = false;
    std::atomic<int> all = 0, regular = 0;
    std::promise<void> ended;
  };
  auto reads = std::make_shared<Reads>();
  std::future<void> ended = reads->ended.get_future();
  std::thread([reads, path] {
    while (!reads->stop) {
      reads->regular += ReadSafetensors(path).ok();
      ++reads->all;
    }
    reads->ended.set_value();
  }).detach();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  stop = true;
  swapper.join();
  reads->stop = true;
  // A read blocked opening a FIFO, since unlinked so that no writer can ever come, never ends.
  ASSERT_EQ(ended.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "the reader is blocked opening a FIFO after " << reads->all << " reads";
  EXPECT_GT(reads->regular, 0);
  EXPECT_GT(reads->all, reads->regular) << "no read met the FIFO: the test tested nothing";
}

TEST_F(SafetensorsTest, ADirectoryIsRefusedNotCrashedOn) {
  EXPECT_EQ(ReadSafetensors(dir_).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, RefusesShortFiles) {
  for (size_t size : {0, 1, 7}) {
    WriteBytes(Path("short"), std::string(size, '\x01'));
    EXPECT_EQ(ReadSafetensors(Path("short")).status().code(), absl::StatusCode::kInvalidArgument)
        << size << " bytes";
  }
}

TEST_F(SafetensorsTest, RefusesAHeaderLengthPastTheEnd) {
  const SafetensorsParts parts = MakeSafetensors({F32("a", {1}, {1})});
  const int64_t real = static_cast<int64_t>(parts.header.size());
  for (int64_t length : {real + static_cast<int64_t>(parts.data.size()) + 1,
                         std::numeric_limits<int64_t>::max(), int64_t{1} << 40}) {
    EXPECT_EQ(WriteAndRead(parts, length).status().code(), absl::StatusCode::kInvalidArgument)
        << "declared header length " << length;
  }
}

TEST_F(SafetensorsTest, RefusesAHeaderOverTheLimit) {
  // 100 MiB + 1 of header in a file that holds it (sparse: nothing is written past the '{').
  const uint64_t length = (uint64_t{100} << 20) + 1;
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  WriteBytes(Path("huge"), bytes + "{");
  std::filesystem::resize_file(Path("huge"), 8 + length + 8);
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(Path("huge"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(file.status().message().find("exceeds the limit"), std::string::npos) << file.status();
}

TEST_F(SafetensorsTest, RefusesALengthThatCutsTheHeader) {
  const SafetensorsParts parts = MakeSafetensors({F32("a", {1}, {1})});
  EXPECT_EQ(WriteAndRead(parts, static_cast<int64_t>(parts.header.size()) - 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, RefusesBadJson) {
  // Closing brackets before opening ones once drove the nesting count below zero (found by
  // fuzz_safetensors; out of bounds under UBSan).
  for (const char* header : {"", "{", "not json", "{\"a\": }", "[1, 2]", "\"text\"", "null", "}}{",
                             "]]]]{\"a\": 1}", "{}}}}"}) {
    EXPECT_EQ(ReadHeader(header).status().code(), absl::StatusCode::kInvalidArgument) << header;
  }
}

TEST_F(SafetensorsTest, RefusesANulByteAndNestingNoHeaderHas) {
  const std::string good = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  ASSERT_TRUE(ReadHeader(good).ok());
  // A JSON parser may stop at a NUL and take the rest for the end of input.
  absl::StatusOr<SafetensorsFile> nul = ReadHeader(good + std::string(1, '\0') + "}}{{ not json");
  EXPECT_EQ(nul.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(nul.status().message().find("NUL byte"), std::string::npos) << nul.status();
  // Valid JSON, one level deeper than a header (a nested document of megabytes would cost
  // gigabytes to parse).
  absl::StatusOr<SafetensorsFile> deep = ReadHeader(
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": {"y": [1]}}})");
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(deep.status().message().find("nests deeper"), std::string::npos) << deep.status();
  // Brackets and escaped quotes inside a name are not nesting.
  absl::StatusOr<SafetensorsFile> named =
      ReadHeader(R"({"a[[{{\"[{": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->tensors.count("a[[{{\"[{"), 1u);
}

TEST_F(SafetensorsTest, RefusesMalformedEntries) {
  for (
      const char* header : {
          R"({"a": 1})",
          R"({"a": {"shape": [2], "data_offsets": [0, 8]}})",
          R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})",
          R"({"a": {"dtype": "F32", "shape": [2]}})",
          R"({"a": {"dtype": 5, "shape": [2], "data_offsets": [0, 8]}})",
          R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})",
          R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})",
          R"({"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}})",
          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})",
          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})",
          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, -8]}})",
          R"({"__metadata__": {"num_heads": 4}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
          R"({"__metadata__": [], "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
      }) {
    EXPECT_EQ(ReadHeader(header).status().code(), absl::StatusCode::kInvalidArgument) << header;
  }
}

TEST_F(SafetensorsTest, RefusesOffsetsOutOfRangeOverlappingOrNotCovering) {
  for (const char* header : {
           // past the end of the 8 data bytes
           R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}})",
           // overlapping
           R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
           // a gap at the start, and trailing bytes
           R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
           R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
           // no tensors at all over 8 bytes of data
           R"({})",
       }) {
    EXPECT_EQ(ReadHeader(header).status().code(), absl::StatusCode::kInvalidArgument) << header;
  }
}

// A tensor whose offsets were moved past the end (by 1e12) once left a gap at its old place
// that was reported first, against its neighbour: "bytes 0..8 belong to no tensor" on 'b'.
TEST_F(SafetensorsTest, DataPastTheEndOfTheFileNamesItsTensor) {
  // 'a' and 'b' of 8 bytes each; 16 bytes of data in a file of 8 + header + 16 bytes.
  auto header = [](const std::string& a_offsets) {
    return absl::StrCat(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": )", a_offsets,
                        R"(}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})");
  };
  for (const std::string& offsets :
       {std::string("[1000000000000, 1000000000008]"),
        // past the end and of the wrong size at once
        std::string("[0, 1000000000000]"),
        // an end that, added to the header's bytes, would overflow 64 bits
        std::string("[0, 18446744073709551615]")}) {
    const std::string text = header(offsets);
    const absl::Status status = ReadHeader(text, 16).status();
    const std::string file_bytes = absl::StrCat(8 + text.size() + 16);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << offsets;
    EXPECT_TRUE(Contains(status, "tensor 'a'")) << status;
    EXPECT_TRUE(Contains(status, "past the end of the file")) << status;
    EXPECT_TRUE(Contains(status, Path("file.safetensors"))) << status;
    EXPECT_TRUE(Contains(status, absl::StrCat("file (", file_bytes, " bytes)"))) << status;
    EXPECT_TRUE(Contains(status, offsets)) << status;
    EXPECT_FALSE(Contains(status, "belong to no tensor")) << status;
  }
}

TEST_F(SafetensorsTest, RefusesShapesThatDoNotMatchTheByteSize) {
  EXPECT_EQ(ReadHeader(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A shape whose byte size overflows 64 bits must not wrap around to a small number.
  EXPECT_EQ(
      ReadHeader(R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 4611686018427387904, 4],
                             "data_offsets": [0, 0]}})",
                 0)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadHeader(R"({"a": {"dtype": "F32", "shape": [18446744073709551615],
                             "data_offsets": [0, 8]}})")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, RefusesUnsupportedAndUnknownDtypes) {
  for (const char* header : {
           R"({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})",
           R"({"a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})",
           R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})",
           R"({"a": {"dtype": "Q7", "shape": [8], "data_offsets": [0, 8]}})",
       }) {
    absl::StatusOr<SafetensorsFile> file = ReadHeader(header);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << header;
    EXPECT_NE(file.status().message().find("'a'"), std::string::npos) << file.status();
  }
}

// The filtered read skips what it was not asked for, whatever its dtype, but still checks the
// file's layout as a whole.
TEST_F(SafetensorsTest, FilteredReadIgnoresUnwantedTensors) {
  TensorToWrite ids;
  ids.name = "position_ids";
  ids.dtype = "I64";
  ids.shape = {2};
  ids.raw = std::string(16, '\0');
  const std::string path = Path("filtered.safetensors");
  WriteSafetensorsFile(path, MakeSafetensors({ids, F32("layer.w", {2}, {1, 2})}));
  EXPECT_EQ(ReadSafetensors(path).status().code(), absl::StatusCode::kInvalidArgument);
  auto file =
      ReadSafetensors(path, [](std::string_view name) { return name.starts_with("layer."); });
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->tensors.size(), 1u);
  EXPECT_EQ(file->tensors.at("layer.w").values, (std::vector<float>{1, 2}));
}

TEST_F(SafetensorsTest, MessagesNameTheFileAndTheTensor) {
  absl::StatusOr<SafetensorsFile> file =
      ReadHeader(R"({"weird_tensor": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})");
  ASSERT_FALSE(file.ok());
  EXPECT_NE(file.status().message().find(Path("file.safetensors")), std::string::npos);
  EXPECT_NE(file.status().message().find("weird_tensor"), std::string::npos);
}

// A header within the 100 MB cap once expanded to gigabytes: 50 M dimensions in one shape, or
// millions of empty tensors. Bounds that real files never reach refuse them, on the text and
// before parsing, with a short message that names the tensor.
TEST_F(SafetensorsTest, BoundsDimensionsTensorsAndMetadataEntries) {
  auto entry = [](const std::string& name, const std::string& shape, int64_t bytes) {
    return absl::StrCat("\"", name, "\": {\"dtype\": \"F32\", \"shape\": [", shape,
                        "], \"data_offsets\": [0, ", bytes, "]}");
  };
  // Rank 8 is read; rank 9 is refused, naming the tensor.
  ASSERT_TRUE(ReadHeader("{" + entry("a", "1,1,1,1,1,1,1,1", 4) + "}", 4).ok());
  absl::StatusOr<SafetensorsFile> rank9 =
      ReadHeader("{" + entry("rank9", "1,1,1,1,1,1,1,1,1", 4) + "}", 4);
  EXPECT_EQ(rank9.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(rank9.status().message().find("'rank9'"), std::string::npos) << rank9.status();
  // A million zero dimensions (2 MB of header): refused, in a message of a line.
  std::string zeros = "0";
  for (int i = 1; i < 1'000'000; ++i) zeros += ",0";
  absl::StatusOr<SafetensorsFile> wide = ReadHeader("{" + entry("wide", zeros, 0) + "}", 0);
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wide.status().message().find("'wide'"), std::string::npos);
  EXPECT_LT(wide.status().message().size(), 300u) << wide.status();

  // 16384 empty tensors are read; one more is refused.
  std::string many = "{" + entry("t0", "0", 0);
  for (int i = 1; i < 16384; ++i) absl::StrAppend(&many, ",", entry(absl::StrCat("t", i), "0", 0));
  absl::StatusOr<SafetensorsFile> most = ReadHeader(many + "}", 0);
  ASSERT_TRUE(most.ok()) << most.status();
  EXPECT_EQ(most->tensors.size(), 16384u);
  absl::StatusOr<SafetensorsFile> too_many = ReadHeader(many + "," + entry("t", "0", 0) + "}", 0);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(too_many.status().message().size(), 300u) << too_many.status();

  // __metadata__: 1024 entries are read, 1025 refused.
  std::string metadata = "\"__metadata__\": {\"k0\": \"v\"";
  for (int i = 1; i < 1024; ++i) metadata += absl::StrCat(", \"k", i, "\": \"v\"");
  const std::string tensor = entry("a", "1", 4);
  absl::StatusOr<SafetensorsFile> full = ReadHeader("{" + metadata + "}, " + tensor + "}", 4);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->metadata.size(), 1024u);
  EXPECT_EQ(ReadHeader("{" + metadata + ", \"k\": \"v\"}, " + tensor + "}", 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A tensor's entry with many keys (a spec entry has three).
  std::string keys;
  for (int i = 0; i < 9; ++i) keys += absl::StrCat(", \"x", i, "\": 0");
  absl::StatusOr<SafetensorsFile> keyed = ReadHeader(
      R"({"keyed": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4])" + keys + "}}", 4);
  EXPECT_EQ(keyed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(keyed.status().message().find("'keyed'"), std::string::npos) << keyed.status();
}

// A name in a header can be megabytes long: messages quote its start, not all of it.
TEST_F(SafetensorsTest, MessagesClipLongNames) {
  const std::string name = "start_of_the_name_" + std::string(1'000'000, 'x');
  absl::StatusOr<SafetensorsFile> file = ReadHeader(
      absl::StrCat(R"({")", name, R"(": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(file.status().message().find("'start_of_the_name_x"), std::string::npos);
  EXPECT_LT(file.status().message().size(), 400u) << file.status().message().substr(0, 400);
  const std::string dtype(1'000'000, 'Q');
  absl::StatusOr<SafetensorsFile> typed = ReadHeader(
      absl::StrCat(R"({"a": {"dtype": ")", dtype, R"(", "shape": [2], "data_offsets": [0, 8]}})"));
  EXPECT_EQ(typed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(typed.status().message().size(), 400u) << typed.status().message().substr(0, 400);
  EXPECT_EQ(NameForMessage("short"), "short");
  // A cut never splits a UTF-8 character: 99 ASCII bytes then 'é' (2 bytes) across byte 100.
  const std::string accented = std::string(99, 'a') + "\xc3\xa9" + std::string(10, 'b');
  EXPECT_EQ(NameForMessage(accented), std::string(99, 'a') + "... (111 bytes)");
}

// Every truncation of a good file and every single-byte change of its header is answered with
// a status (mostly a refusal), never a crash or an exception.
TEST_F(SafetensorsTest, SurvivesTruncationAndHeaderCorruption) {
  const SafetensorsParts parts = MakeSafetensors(
      {F32("a", {2, 2}, {1, 2, 3, 4}), Raw("b", "F16", {2}, {0x3c00, 0x4000})}, {{"k", "v"}});
  std::string bytes;
  {
    const std::string path = Path("good");
    WriteSafetensorsFile(path, parts);
    ASSERT_TRUE(ReadSafetensors(path).ok());
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  for (size_t size = 0; size < bytes.size(); ++size) {
    WriteBytes(Path("cut"), bytes.substr(0, size));
    EXPECT_FALSE(ReadSafetensors(Path("cut")).ok()) << "truncated to " << size;
  }
  for (size_t i = 0; i < 8 + parts.header.size(); ++i) {
    for (char replacement : {'\0', '"', '9', '}', '\xff'}) {
      std::string changed = bytes;
      changed[i] = replacement;
      WriteBytes(Path("changed"), changed);
      (void)ReadSafetensors(Path("changed"));  // any status; what matters is that we get one
    }
  }
}

}  // namespace
}  // namespace attnserve::core
