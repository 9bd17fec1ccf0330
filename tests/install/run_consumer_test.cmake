# Installs the RoundPipe build into WORK_DIR/prefix, then configures, builds and runs the consumer
# project against it with find_package(RoundPipe). Fails on any step.
function(run_step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (exit ${rc}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}/prefix" "${WORK_DIR}/build" "${WORK_DIR}/run")
# The parent build's prefixes reach the consumer's find_package through the environment (a list
# argument would be split by run_step's ARGN).
string(REPLACE "|" ":" parent_prefix_path "${PARENT_PREFIX_PATH}")
set(ENV{CMAKE_PREFIX_PATH} "${parent_prefix_path}")
find_program(CCACHE_PROGRAM ccache)
set(launcher "")
if(CCACHE_PROGRAM)
  set(launcher "-DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE_PROGRAM}")
endif()
run_step(${CMAKE_COMMAND} --install "${ROUNDPIPE_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# The installed launcher starts in a clean environment (no LD_LIBRARY_PATH): its RPATH finds
# LibTorch. --help, then one training step of the README's config (on synthetic data) into WORK_DIR.
set(clean_env env -i "PATH=/usr/local/bin:/usr/bin:/bin" "HOME=${WORK_DIR}")
run_step(${clean_env} "${WORK_DIR}/prefix/bin/roundpipe" --help)
run_step(${clean_env} "${WORK_DIR}/prefix/bin/roundpipe" train "${LAUNCHER_CONFIG}" train.steps=1
         data.format=synthetic data.train=null data.valid=null "out_dir=${WORK_DIR}/run")
run_step(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
  "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" "-DTorch_DIR=${TORCH_DIR}"
  "-DCMAKE_CXX_FLAGS=${PARENT_CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${PARENT_LINKER_FLAGS}"
  -DCMAKE_BUILD_TYPE=Release ${launcher})
run_step(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run_step("${WORK_DIR}/build/consumer")
