#pragma once

// Whether the tests are built with AddressSanitizer or ThreadSanitizer (gcc or clang): their
// allocators and shadow memory change what a process's memory figures mean, and their own
// mappings pass any address space limit.

namespace attnserve::test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace attnserve::test
