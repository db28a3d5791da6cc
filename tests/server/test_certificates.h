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
// one bundle (both_cas.crt); a third CA of the first's very name, CN=test-ca,
// under another key (twin_ca.crt), with its own CN=client certificate
// (twin.crt, twin.key), and all three CAs in one bundle (all_cas.crt); the
// first CA's CN=client again under a new key (reissued.crt, reissued.key);
// and two certificates of the first CA with an empty subject, each naming
// its workload by a SPIFFE URI SAN alone, as service meshes do (spiffe_a.crt,
// spiffe_b.crt and their keys); the first CA's CN=client with its SANs in the
// other order (reordered.crt, reordered.key); and, for the server's
// certificate, an RSA-1024 one the first CA signed (weak.crt, weak.key),
// which OpenSSL's default security level will not serve, and one valid only
// from 2100 (future.crt, future.key). The folder is removed with the last
// owner, so private keys do not pile up in the temporary directory run after
// run.
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
        twin_cert(std::move(other.twin_cert)),
        twin_key(std::move(other.twin_key)),
        reissued_cert(std::move(other.reissued_cert)),
        reissued_key(std::move(other.reissued_key)),
        spiffe_a_cert(std::move(other.spiffe_a_cert)),
        spiffe_a_key(std::move(other.spiffe_a_key)),
        spiffe_b_cert(std::move(other.spiffe_b_cert)),
        spiffe_b_key(std::move(other.spiffe_b_key)),
        reordered_cert(std::move(other.reordered_cert)),
        reordered_key(std::move(other.reordered_key)),
        weak_cert(std::move(other.weak_cert)),
        weak_key(std::move(other.weak_key)),
        future_cert(std::move(other.future_cert)),
        future_key(std::move(other.future_key)),
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
  std::string twin_cert, twin_key, reissued_cert, reissued_key;
  std::string spiffe_a_cert, spiffe_a_key, spiffe_b_cert, spiffe_b_key;
  std::string reordered_cert, reordered_key, weak_cert, weak_key;
  std::string future_cert, future_key;
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
      "cat ca.crt second_ca.crt > both_cas.crt;",
      // sign NAME CA SUBJECT EXTENSIONS: NAME.crt and NAME.key.
      "sign() { openssl req -newkey rsa:2048 -nodes -subj \"$3\" -keyout "
      "$1.key -out $1.csr 2>/dev/null; printf \"$4\\n\" > $1.ext;",
      "openssl x509 -req -in $1.csr -CA $2.crt -CAkey $2.key -CAcreateserial "
      "-days 1 -extfile $1.ext -out $1.crt 2>/dev/null; };",
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca "
      "-keyout twin_ca.key -out twin_ca.crt 2>/dev/null;",
      "sign twin twin_ca /CN=client subjectAltName=IP:127.0.0.1,DNS:localhost;",
      "sign reissued ca /CN=client subjectAltName=IP:127.0.0.1,DNS:localhost;",
      "sign spiffe_a ca / subjectAltName=URI:spiffe://test/ns/a/sa/tenant;",
      "sign spiffe_b ca / subjectAltName=URI:spiffe://test/ns/b/sa/tenant;",
      "sign reordered ca /CN=client subjectAltName=DNS:localhost,IP:127.0.0.1;",
      "openssl req -newkey rsa:1024 -nodes -subj /CN=weak -keyout weak.key "
      "-out weak.csr 2>/dev/null;",
      "openssl x509 -req -in weak.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
      "-days 1 -extfile server.ext -out weak.crt 2>/dev/null;",
      // `openssl ca`, the one way to choose a certificate's dates in 3.0.
      "openssl req -newkey rsa:2048 -nodes -subj /CN=server -keyout future.key "
      "-out future.csr 2>/dev/null; touch index.txt;",
      "printf '[ca]\\ndefault_ca=d\\n[d]\\ndatabase=index.txt\\n"
      "new_certs_dir=.\\nserial=ca.srl\\ndefault_md=sha256\\npolicy=p\\n"
      "copy_extensions=none\\n[p]\\ncommonName=supplied\\n' > ca.cnf;",
      "openssl ca -config ca.cnf -cert ca.crt -keyfile ca.key -in future.csr "
      "-startdate 21000101000000Z -enddate 21000102000000Z -extfile "
      "server.ext -batch -out future.crt 2>/dev/null;",
      "cat ca.crt second_ca.crt twin_ca.crt > all_cas.crt");
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
  certs->twin_cert = ReadFile(dir + "/twin.crt");
  certs->twin_key = ReadFile(dir + "/twin.key");
  certs->reissued_cert = ReadFile(dir + "/reissued.crt");
  certs->reissued_key = ReadFile(dir + "/reissued.key");
  certs->spiffe_a_cert = ReadFile(dir + "/spiffe_a.crt");
  certs->spiffe_a_key = ReadFile(dir + "/spiffe_a.key");
  certs->spiffe_b_cert = ReadFile(dir + "/spiffe_b.crt");
  certs->spiffe_b_key = ReadFile(dir + "/spiffe_b.key");
  certs->reordered_cert = ReadFile(dir + "/reordered.crt");
  certs->reordered_key = ReadFile(dir + "/reordered.key");
  certs->weak_cert = ReadFile(dir + "/weak.crt");
  certs->weak_key = ReadFile(dir + "/weak.key");
  certs->future_cert = ReadFile(dir + "/future.crt");
  certs->future_key = ReadFile(dir + "/future.key");
  return certs;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_TEST_CERTIFICATES_H_
