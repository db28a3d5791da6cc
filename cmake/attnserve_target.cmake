# attnserve_configure_target(<target>)
#
# Applies the project's language level and warning set to one of attnserve's own targets.
# Generated protobuf/gRPC code does not go through this, so its warnings stay out of ours.
function(attnserve_configure_target target)
  target_compile_features(${target} PUBLIC cxx_std_17)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow
                                           -Wnon-virtual-dtor)
  if(ATTNSERVE_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
