// TLS certificates made with openssl for one test run.
#ifndef ATTNSERVE_TESTS_SERVER_TEST_CERTIFICATES_H_
#define ATTNSERVE_TESTS_SERVER_TEST_CERTIFICATES_H_

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attnserve::testing {

// Certificates made with openssl for this test run: a CA, a server certificate
// for 127.0.0.1, and two client certificates (subjects CN=client and
// CN=other), as PEM text, and the folder holding them as files (ca.crt,
// server.crt, server.key, client.crt, client.key, other.crt, other.key); and
// a second CA (second_ca.crt) with a client certificate of its own under the
// first's subject, CN=client (impostor.crt, impostor.key), and both CAs in
// one bundle (both_cas.crt). The
// folder is removed with the last owner, so private keys do not pile up in the
// temporary directory run after run.
struct TestCertificates {
  TestCertificates() = default;
  TestCertificates(const TestCertificates&) = delete;
  TestCertificates& operator=(const TestCertificates&) = delete;
  TestCertificates(TestCertificates&& other) noexcept
      : ca(std::move(other.ca)),
        server_cert(std::move(other.server_cert)),
        server_key(std::move(other.server_key)),
        client_cert(std::move(other.client_cert)),
        client_key(std::move(other.client_key)),
        other_cert(std::move(other.other_cert)),
        other_key(std::move(other.other_key)),
        second_ca(std::move(other.second_ca)),
        impostor_cert(std::move(other.impostor_cert)),
        impostor_key(std::move(other.impostor_key)),
        directory(std::exchange(other.directory, std::string())) {}
  TestCertificates& operator=(TestCertificates&&) = delete;
  ~TestCertificates() {
    if (directory.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(directory, ignored);
  }

  std::string ca, server_cert, server_key, client_cert, client_key;
  std::string other_cert, other_key;
  std::string second_ca, impostor_cert, impostor_key;
  std::string directory;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

inline std::optional<TestCertificates> MakeCertificates() {
  // Per process: tests that make certificates may run at the same time.
  const std::string dir =
      ::testing::TempDir() + "/tls-" + std::to_string(getpid());
  const std::string script = absl::StrCat(
      "set -e; rm -rf ", dir, "; mkdir -p ", dir, "; cd ", dir, ";",
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca "
      "-keyout ca.key "
      "-out ca.crt 2>/dev/null;",
      "for who in server client other; do ",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=$who -keyout $who.key "
      "-out $who.csr "
      "2>/dev/null;",
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > $who.ext;",
      "openssl x509 -req -in $who.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
      "-days 1 "
      "-extfile $who.ext -out $who.crt 2>/dev/null; done;",
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=second-ca "
      "-keyout second_ca.key -out second_ca.crt 2>/dev/null;",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=client -keyout "
      "impostor.key -out impostor.csr 2>/dev/null;",
      "openssl x509 -req -in impostor.csr -CA second_ca.crt -CAkey "
      "second_ca.key -CAcreateserial -days 1 -extfile client.ext -out "
      "impostor.crt 2>/dev/null;",
      "cat ca.crt second_ca.crt > both_cas.crt");
  const std::string script_path = dir + ".sh";
  std::ofstream(script_path) << script << "\n";
  const int exit_status = std::system(("bash " + script_path).c_str());
  std::error_code ignored;
  std::filesystem::remove(script_path, ignored);
  std::optional<TestCertificates> certs(std::in_place);
  certs->directory = dir;  // removed with certs from here on, made or not
  if (exit_status != 0) return std::nullopt;
  certs->ca = ReadFile(dir + "/ca.crt");
  certs->server_cert = ReadFile(dir + "/server.crt");
  certs->server_key = ReadFile(dir + "/server.key");
  certs->client_cert = ReadFile(dir + "/client.crt");
  certs->client_key = ReadFile(dir + "/client.key");
  certs->other_cert = ReadFile(dir + "/other.crt");
  certs->other_key = ReadFile(dir + "/other.key");
  certs->second_ca = ReadFile(dir + "/second_ca.crt");
  certs->impostor_cert = ReadFile(dir + "/impostor.crt");
  certs->impostor_key = ReadFile(dir + "/impostor.key");
  return certs;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_TEST_CERTIFICATES_H_
