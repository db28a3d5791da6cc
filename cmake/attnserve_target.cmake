# attnserve_configure_target(<target>)
#
# Applies the project's language level and warning set to one of attnserve's own targets, and
# the sanitizers of ATTNSERVE_SANITIZE. Generated protobuf/gRPC code does not go through this, so
# its warnings stay out of ours; it gets the sanitizers through attnserve_sanitize_target.
function(attnserve_configure_target target)
  target_compile_features(${target} PUBLIC cxx_std_17)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow
                                           -Wnon-virtual-dtor)
  if(ATTNSERVE_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  attnserve_sanitize_target(${target})
endfunction()

# ATTNSERVE_SANITIZE: the sanitizers every attnserve target (ours, the generated proto code and
# the tests) is compiled and linked with, as a comma-separated -fsanitize= list: empty (the
# default, none), "address,undefined" or "thread". scripts/sanitize builds both kinds.
# Undefined behaviour aborts instead of printing and carrying on, so a test that hits it fails.
# Debian's gRPC, protobuf, Abseil, oneDNN and libgomp stay uninstrumented.
set(ATTNSERVE_SANITIZE "" CACHE STRING
    "Sanitizers for attnserve's targets: empty, address,undefined, or thread")
set_property(CACHE ATTNSERVE_SANITIZE PROPERTY STRINGS "" "address,undefined" "thread")
if(ATTNSERVE_SANITIZE)
  string(REPLACE "," ";" sanitizers "${ATTNSERVE_SANITIZE}")
  foreach(sanitizer IN LISTS sanitizers)
    if(NOT sanitizer MATCHES "^(address|undefined|thread)$")
      message(FATAL_ERROR "ATTNSERVE_SANITIZE: unknown sanitizer '${sanitizer}' in "
                          "'${ATTNSERVE_SANITIZE}'; expected address, undefined or thread")
    endif()
  endforeach()
  if("thread" IN_LIST sanitizers AND "address" IN_LIST sanitizers)
    message(FATAL_ERROR "ATTNSERVE_SANITIZE: thread and address cannot be combined")
  endif()
  set(ATTNSERVE_SANITIZE_FLAGS -fsanitize=${ATTNSERVE_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST sanitizers)
    list(APPEND ATTNSERVE_SANITIZE_FLAGS -fno-sanitize-recover=undefined)
  endif()
endif()

# attnserve_sanitize_target(<target>)
#
# Compiles and links <target> with ATTNSERVE_SANITIZE's sanitizers; does nothing when it is empty.
function(attnserve_sanitize_target target)
  if(ATTNSERVE_SANITIZE_FLAGS)
    target_compile_options(${target} PRIVATE ${ATTNSERVE_SANITIZE_FLAGS})
    target_link_options(${target} PRIVATE ${ATTNSERVE_SANITIZE_FLAGS})
  endif()
endfunction()
