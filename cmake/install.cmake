# `cmake --install build --prefix PREFIX`: the server and attnctl in PREFIX/bin, and the C++
# client library for programs built outside this tree (docs/client.md, "Building against an
# installed attnserve"):
#
#   include/attnserve/{client,proto,common}/*.h   the client's headers and what they include
#   include/attnserve/v1/attention*.pb.h           the generated API (and grpc/health/v1's)
#   lib/libattnserve_{client,proto_util,proto,common}.a
#   lib/cmake/attnserve/                           find_package(attnserve CONFIG) → attnserve::client
#   lib/pkgconfig/attnserve-client.pc              pkg-config --cflags --libs attnserve-client
#   share/attnserve/proto/                         attention.proto, for stubs in other languages
#
# The libraries are static, built as this tree builds them; the package finds the same Debian
# packages (protobuf, gRPC, Abseil) the build used. A sanitized build (ATTNSERVE_SANITIZE) is
# not meant for installing: its libraries need the sanitizer runtime at link time.
include(CMakePackageConfigHelpers)

set(attnserve_client_libraries attnserve_client attnserve_proto_util attnserve_proto
                               attnserve_common)
set_target_properties(attnserve_client PROPERTIES EXPORT_NAME client)
set_target_properties(attnserve_proto_util PROPERTIES EXPORT_NAME proto_util)
set_target_properties(attnserve_proto PROPERTIES EXPORT_NAME proto)
set_target_properties(attnserve_common PROPERTIES EXPORT_NAME common)

install(TARGETS attnserve attnctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS ${attnserve_client_libraries}
  EXPORT attnserveTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/attnserve
                  ${PROJECT_SOURCE_DIR}/proto/include/attnserve
                  ${PROJECT_SOURCE_DIR}/common/include/attnserve
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h"
  # attnserve_flags_help (the programs' --help) is not part of the client library.
  PATTERN "flags_help.h" EXCLUDE)
set(generated_dir ${PROJECT_BINARY_DIR}/proto/generated)
install(FILES ${generated_dir}/attnserve/v1/attention.pb.h
              ${generated_dir}/attnserve/v1/attention.grpc.pb.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/attnserve/v1)
install(FILES ${generated_dir}/grpc/health/v1/health.pb.h
              ${generated_dir}/grpc/health/v1/health.grpc.pb.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/grpc/health/v1)
install(FILES ${PROJECT_SOURCE_DIR}/proto/attnserve/v1/attention.proto
  DESTINATION ${CMAKE_INSTALL_DATADIR}/attnserve/proto/attnserve/v1)

set(config_dir ${CMAKE_INSTALL_LIBDIR}/cmake/attnserve)
install(EXPORT attnserveTargets NAMESPACE attnserve:: DESTINATION ${config_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/attnserveConfig.cmake.in
  ${PROJECT_BINARY_DIR}/attnserveConfig.cmake
  INSTALL_DESTINATION ${config_dir})
# Any 0.x release differs from the next in its API: only the same minor version matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/attnserveConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/attnserveConfig.cmake
              ${PROJECT_BINARY_DIR}/attnserveConfigVersion.cmake
  DESTINATION ${config_dir})

# pkg-config: static libraries, so their dependencies are in Requires, not Requires.private.
file(RELATIVE_PATH pc_to_prefix /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
string(REGEX REPLACE "/$" "" pc_to_prefix "${pc_to_prefix}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/attnserve-client.pc.in
  ${PROJECT_BINARY_DIR}/attnserve-client.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/attnserve-client.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
