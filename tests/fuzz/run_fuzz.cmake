# cmake -DFUZZER=bin -DSEEDS=dir -DDICT=file -DWORK=dir -DSECONDS=n -P run_fuzz.cmake
#
# Fuzzes for SECONDS from a fresh copy of the seeds (libFuzzer adds what it finds to its corpus
# directory; the committed seeds stay as they are). Fails on any crash, sanitizer report,
# timeout, oversized malloc or RSS; the reproducer is left in WORK/artifacts/.
foreach(var FUZZER SEEDS DICT WORK SECONDS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzz.cmake: -D${var}= is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/corpus ${WORK}/artifacts)
file(GLOB seeds ${SEEDS}/*)
file(COPY ${seeds} DESTINATION ${WORK}/corpus)
execute_process(
  COMMAND ${FUZZER} -max_total_time=${SECONDS} -rss_limit_mb=2048 -malloc_limit_mb=64
          -max_len=65536 -timeout=10 -dict=${DICT} -artifact_prefix=${WORK}/artifacts/
          -print_final_stats=1 ${WORK}/corpus
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gguf_fuzz failed (exit ${rc}): reproducer in ${WORK}/artifacts/")
endif()
