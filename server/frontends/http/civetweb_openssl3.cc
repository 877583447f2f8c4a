#include "server/frontends/http/civetweb_openssl3.h"

#include <dlfcn.h>
#include <link.h>
#include <openssl/ssl.h>

#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace attnserve::server {
namespace {

struct Segment {
  uintptr_t start = 0;
  size_t size = 0;
  bool writable = false;
};

// The loaded segments of libcivetweb.
std::vector<Segment> CivetwebSegments() {
  std::vector<Segment> segments;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, "libcivetweb") == nullptr) {
          return 0;
        }
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& header = info->dlpi_phdr[i];
          if (header.p_type != PT_LOAD) continue;
          static_cast<std::vector<Segment>*>(out)->push_back(
              {info->dlpi_addr + header.p_vaddr, header.p_memsz, (header.p_flags & PF_W) != 0});
        }
        return 1;
      },
      &segments);
  return segments;
}

// Addresses of the NUL-terminated `name` in the read-only segments.
std::vector<uintptr_t> FindString(const std::vector<Segment>& segments, std::string_view name) {
  std::vector<uintptr_t> found;
  for (const Segment& s : segments) {
    if (s.writable) continue;
    const std::string_view bytes(reinterpret_cast<const char*>(s.start), s.size);
    for (size_t at = bytes.find(name); at != std::string_view::npos;
         at = bytes.find(name, at + 1)) {
      if (at + name.size() < bytes.size() && bytes[at + name.size()] == '\0' &&
          (at == 0 || bytes[at - 1] == '\0')) {
        found.push_back(s.start + at);
      }
    }
  }
  return found;
}

// Addresses of the words in the writable segments that hold one of `targets`.
std::vector<uintptr_t*> FindPointers(const std::vector<Segment>& segments,
                                     const std::vector<uintptr_t>& targets) {
  std::vector<uintptr_t*> found;
  for (const Segment& s : segments) {
    if (!s.writable) continue;
    auto* word = reinterpret_cast<uintptr_t*>((s.start + 7) & ~uintptr_t{7});
    auto* end = reinterpret_cast<uintptr_t*>(s.start + s.size - sizeof(uintptr_t) * 3);
    for (; word < end; ++word) {
      for (uintptr_t target : targets) {
        if (*word == target) found.push_back(word);
      }
    }
  }
  return found;
}

X509* GetPeerCertificate(const SSL* ssl) { return SSL_get1_peer_certificate(ssl); }

}  // namespace

bool RepairCivetwebOpenSsl3() {
  const std::vector<Segment> segments = CivetwebSegments();
  // Where, after an entry's name, its function pointer is: found on an entry that loaded.
  const void* accept = dlsym(RTLD_DEFAULT, "SSL_accept");
  int offset = 0;
  for (uintptr_t* entry : FindPointers(segments, FindString(segments, "SSL_accept"))) {
    for (int words : {1, 2}) {
      if (entry[words] == reinterpret_cast<uintptr_t>(accept)) offset = words;
    }
  }
  if (offset == 0 || accept == nullptr) return false;
  bool repaired = false;
  for (uintptr_t* entry :
       FindPointers(segments, FindString(segments, "SSL_get_peer_certificate"))) {
    if (entry[offset] == 0) {
      entry[offset] = reinterpret_cast<uintptr_t>(&GetPeerCertificate);
      repaired = true;
    } else if (entry[offset] == reinterpret_cast<uintptr_t>(&GetPeerCertificate)) {
      repaired = true;  // a second server in the process
    }
  }
  return repaired;
}

}  // namespace attnserve::server
