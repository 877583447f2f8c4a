#pragma once

namespace attnserve::server {

// Debian 12's civetweb 1.15 loads libssl at run time by the OpenSSL 1.1 names, and one of them,
// SSL_get_peer_certificate, is a macro in OpenSSL 3 (the symbol is SSL_get1_peer_certificate):
// its pointer stays null and the first TLS connection crashes the process. This fills that one
// entry of civetweb's loaded function table with SSL_get1_peer_certificate (same contract: a
// reference the caller frees). Call after civetweb loaded TLS (mg_init_library with TLS);
// false when the table was not found (then TLS must not be served).
bool RepairCivetwebOpenSsl3();

}  // namespace attnserve::server
