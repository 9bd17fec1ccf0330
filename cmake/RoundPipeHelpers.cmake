# Helpers shared by every module's CMakeLists: global flags, module libraries, the shared
# precompiled header, and test registration.
include_guard(GLOBAL)

function(roundpipe_global_flags)
  add_compile_options(-Wall -Wextra)
  if(ROUNDPIPE_WERROR)
    add_compile_options(-Werror)
  endif()
  if(ROUNDPIPE_SANITIZE)
    # A comma-separated list: thread, address, undefined, or address,undefined (docs/sanitizers.md).
    if(NOT ROUNDPIPE_SANITIZE MATCHES "^(thread|address|undefined|address,undefined|undefined,address)$")
      message(FATAL_ERROR "ROUNDPIPE_SANITIZE='${ROUNDPIPE_SANITIZE}' is not one of thread, address, "
        "undefined, address,undefined (ThreadSanitizer cannot be combined with the others)")
    endif()
    add_compile_options(-fsanitize=${ROUNDPIPE_SANITIZE} -fno-omit-frame-pointer)
    add_link_options(-fsanitize=${ROUNDPIPE_SANITIZE})
  endif()
  if(ROUNDPIPE_FUZZ)
    if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
      message(FATAL_ERROR "ROUNDPIPE_FUZZ=ON needs clang (libFuzzer): configure with CXX=clang++ "
        "(CMAKE_CXX_COMPILER is ${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER})")
    endif()
    # Coverage instrumentation for libFuzzer in every library; only the fuzz targets link its main.
    add_compile_options(-fsanitize=fuzzer-no-link)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    # Lets ccache reuse clang's precompiled header (it refuses PCHs that embed a timestamp).
    add_compile_options("SHELL:-Xclang -fno-pch-timestamp")
  endif()
endfunction()

# One object library owns the LibTorch precompiled header; every target that uses LibTorch
# reuses it (identical flags are guaranteed by global options + the generated config header).
function(roundpipe_use_pch target)
  if(NOT ROUNDPIPE_PCH)
    return()
  endif()
  if(NOT TARGET roundpipe_pch)
    add_library(roundpipe_pch OBJECT "${PROJECT_SOURCE_DIR}/cmake/pch/roundpipe_pch.cpp")
    target_link_libraries(roundpipe_pch PRIVATE torch)
    target_include_directories(roundpipe_pch PRIVATE "${PROJECT_SOURCE_DIR}" "${PROJECT_BINARY_DIR}/generated")
    target_precompile_headers(roundpipe_pch PRIVATE "${PROJECT_SOURCE_DIR}/cmake/pch/roundpipe_pch.h")
  endif()
  target_precompile_headers(${target} REUSE_FROM roundpipe_pch)
endfunction()

# Installed headers live under one project folder, <prefix>/include/roundpipe/<module>/..., and
# consumers get <prefix>/include/roundpipe on their include path: `#include <roundpipe/roundpipe.h>`
# works and no top-level folder (amp/, optim/, ...) can collide with another package's.
set(ROUNDPIPE_INSTALL_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}/roundpipe")

# Installs the calling folder's public headers (*.h, not detail/) under the project folder, and
# registers them for the self-containment check (roundpipe_header_check). INTERNAL: check only.
function(roundpipe_install_headers)
  cmake_parse_arguments(ARG "INTERNAL" "" "" ${ARGN})
  file(GLOB headers CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/*.h")
  file(RELATIVE_PATH rel "${PROJECT_SOURCE_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}")
  if(NOT ARG_INTERNAL)
    install(FILES ${headers} DESTINATION ${ROUNDPIPE_INSTALL_INCLUDEDIR}/${rel})
  endif()
  set_property(GLOBAL APPEND PROPERTY ROUNDPIPE_PUBLIC_HEADERS ${headers})
endfunction()

# roundpipe_add_module(<module> SOURCES ... [C10_ONLY] [INTERNAL] [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# Creates static library roundpipe_<module>, alias roundpipe::<module>, headers root-relative.
# Links LibTorch (and the shared PCH) unless C10_ONLY: then only c10 (TORCH_CHECK, ScalarType).
# INTERNAL: part of an executable (the launcher), not installed with find_package(RoundPipe).
function(roundpipe_add_module module)
  cmake_parse_arguments(ARG "C10_ONLY;INTERNAL" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  set(target roundpipe_${module})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(roundpipe::${module} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${module} OUTPUT_NAME roundpipe_${module})
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/generated>
    $<INSTALL_INTERFACE:${ROUNDPIPE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${target} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  if(ARG_C10_ONLY)
    target_link_libraries(${target} PUBLIC c10)
  else()
    target_link_libraries(${target} PUBLIC torch)
    roundpipe_use_pch(${target})
  endif()
  set_property(GLOBAL APPEND PROPERTY ROUNDPIPE_MODULE_TARGETS ${target})
  if(ARG_INTERNAL)
    roundpipe_install_headers(INTERNAL)
  else()
    set_property(GLOBAL APPEND PROPERTY ROUNDPIPE_INSTALL_TARGETS ${target})
    roundpipe_install_headers()
  endif()
endfunction()

# roundpipe_test_timeout(<out-var> <seconds>): the CTest TIMEOUT of a test whose budget in a plain
# build is <seconds> (about 3x its measured time there, docs/getting-started.md, "Timeouts"): at
# least 120 s, times ROUNDPIPE_TEST_TIMEOUT_SCALE (sanitizer builds).
function(roundpipe_test_timeout out seconds)
  if(NOT ROUNDPIPE_TEST_TIMEOUT_SCALE MATCHES "^[1-9][0-9]*$")
    message(FATAL_ERROR "ROUNDPIPE_TEST_TIMEOUT_SCALE='${ROUNDPIPE_TEST_TIMEOUT_SCALE}' must be a positive integer")
  endif()
  if(seconds LESS 120)
    set(seconds 120)
  endif()
  math(EXPR seconds "${seconds} * ${ROUNDPIPE_TEST_TIMEOUT_SCALE}")
  set(${out} ${seconds} PARENT_SCOPE)
endfunction()

# roundpipe_add_gtest(<name> SOURCES ... TIMEOUT s [NO_TORCH] [LIBS ...] [SHARDS n] [LABELS ...])
# One test binary; registered per shard (GTEST_TOTAL_SHARDS) because every LibTorch process costs
# ~1 s to start, or per case with ROUNDPIPE_TEST_PER_CASE=ON (gtest_discover_tests). TIMEOUT: the
# budget of one shard in a plain build, ~3x its measured time (roundpipe_test_timeout).
function(roundpipe_add_gtest name)
  cmake_parse_arguments(ARG "NO_TORCH" "SHARDS;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT ARG_SHARDS)
    set(ARG_SHARDS 1)
  endif()
  if(NOT ARG_TIMEOUT)
    message(FATAL_ERROR "roundpipe_add_gtest(${name}): TIMEOUT <seconds> is required: about 3x one shard's "
      "time in a plain build (at least 120; sanitizer builds scale it, ROUNDPIPE_TEST_TIMEOUT_SCALE)")
  endif()
  roundpipe_test_timeout(ARG_TIMEOUT ${ARG_TIMEOUT})
  add_executable(${name} ${ARG_SOURCES})
  if(ARG_NO_TORCH)
    # Tests of the c10-only modules: GoogleTest's main, no LibTorch, no PCH.
    target_link_libraries(${name} PRIVATE roundpipe_test_main_plain ${ARG_LIBS})
  else()
    target_link_libraries(${name} PRIVATE roundpipe_test_common ${ARG_LIBS})
    roundpipe_use_pch(${name})
  endif()
  if(ROUNDPIPE_TEST_PER_CASE)
    include(GoogleTest)
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 120 PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT})
  else()
    math(EXPR last "${ARG_SHARDS} - 1")
    foreach(i RANGE ${last})
      add_test(NAME ${name}/shard${i} COMMAND ${name})
      set_tests_properties(${name}/shard${i} PROPERTIES
        ENVIRONMENT "GTEST_TOTAL_SHARDS=${ARG_SHARDS};GTEST_SHARD_INDEX=${i}"
        LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT})
    endforeach()
  endif()
endfunction()
