# Generates expertd/stats_fields.h from the control-plane schema (expertd.capnp), the one place the
# fields of its structs are declared: one X-macro list per struct, every plain field (a number,
# bool or Text) in schema order as
#
#   X(cxx_type, snake_name, CamelName, "the schema's trailing comment")
#
# e.g. EXPERTD_SCHEDULER_STATS_FIELDS(X) and EXPERTD_MODEL_LAYOUT_SLICE_FIELDS(X) (nested structs
# are named with their parent). CamelName is the capnp name with a capital first letter, for the
# generated accessors: b.set##CamelName(...), r.get##CamelName(). Lists and struct fields are left
# out (the C++ types declare those by hand; expertd/control_types.h).
#
# Run at build time: cmake -DSCHEMA=expertd.capnp -DOUTPUT=.../expertd/stats_fields.h -P this file.
# The output is rewritten only when it changes.
if(NOT SCHEMA OR NOT OUTPUT)
  message(FATAL_ERROR "usage: cmake -DSCHEMA=<expertd.capnp> -DOUTPUT=<stats_fields.h> -P ${CMAKE_SCRIPT_MODE_FILE}")
endif()

set(cxx_UInt64 uint64_t)
set(cxx_UInt32 uint32_t)
set(cxx_UInt16 uint16_t)
set(cxx_UInt8 uint8_t)
set(cxx_Int64 int64_t)
set(cxx_Int32 int32_t)
set(cxx_Int16 int16_t)
set(cxx_Int8 int8_t)
set(cxx_Bool bool)
set(cxx_Float32 float)
set(cxx_Float64 double)
set(cxx_Text std::string)

# FooBarBaz -> FOO_BAR_BAZ; fooBar -> foo_bar (topK -> top_k, ne0 -> ne0).
function(to_snake out name)
  string(REGEX REPLACE "([a-z0-9])([A-Z])" "\\1_\\2" s "${name}")
  string(TOLOWER "${s}" s)
  set(${out} "${s}" PARENT_SCOPE)
endfunction()

# One list element per line: the characters that CMake lists treat specially are swapped for
# placeholders first (never valid capnp), and put back in the descriptions.
file(READ "${SCHEMA}" content)
string(REPLACE ";" "<SEMI>" content "${content}")
string(REPLACE "[" "<LBR>" content "${content}")
string(REPLACE "]" "<RBR>" content "${content}")
string(REPLACE "\n" ";" lines "${content}")
set(docs "")           # every field with its comment, for EXPERTD_ALL_FIELD_DOCS
set(stack "")          # open braces: a struct's name, or "-" for anything else (interfaces)
set(structs "")        # struct paths in order of appearance (ModelLayout, ModelLayout_Slice, ...)
foreach(line IN LISTS lines)
  # The part before any comment decides structure; the comment is a field's description.
  set(comment "")
  set(code "${line}")
  string(FIND "${line}" "#" hash)
  if(hash GREATER_EQUAL 0)
    string(SUBSTRING "${line}" 0 ${hash} code)
    math(EXPR after "${hash} + 1")
    string(SUBSTRING "${line}" ${after} -1 comment)
    string(STRIP "${comment}" comment)
  endif()
  string(STRIP "${code}" code)
  if(code STREQUAL "")
    continue()
  endif()

  # The innermost open struct, if the innermost brace is one.
  set(current "")
  list(LENGTH stack depth)
  if(depth GREATER 0)
    list(GET stack -1 current)
    if(current STREQUAL "-")
      set(current "")
    endif()
  endif()

  if(current AND code MATCHES "^([a-z][A-Za-z0-9]*) +@([0-9]+) *: *([A-Za-z0-9_.()]+) *(=.*)?<SEMI>$")
    set(field "${CMAKE_MATCH_1}")
    set(type "${CMAKE_MATCH_3}")
    string(REPLACE "\\" "\\\\" doc "${comment}")
    string(REPLACE "\"" "\\\"" doc "${doc}")
    string(APPEND docs " \\\n  X(\"${current}\", \"${field}\", \"${doc}\")")
    if(DEFINED cxx_${type})
      to_snake(snake "${field}")
      string(SUBSTRING "${field}" 0 1 first)
      string(TOUPPER "${first}" first)
      string(SUBSTRING "${field}" 1 -1 rest)
      string(REPLACE "\\" "\\\\" desc "${comment}")
      string(REPLACE "\"" "\\\"" desc "${desc}")
      string(REPLACE "<SEMI>" ";" desc "${desc}")
      string(REPLACE "<LBR>" "[" desc "${desc}")
      string(REPLACE "<RBR>" "]" desc "${desc}")
      string(APPEND fields_${current} " \\\n  X(${cxx_${type}}, ${snake}, ${first}${rest}, \"${desc}\")")
    else()
      list(APPEND skipped_${current} "${field}")
    endif()
    continue()
  endif()

  # Braces: a struct opens a named level; anything else (interface, group, union) an unnamed one.
  string(REGEX MATCHALL "[{}]" braces "${code}")
  set(name "-")
  if(code MATCHES "^struct +([A-Za-z0-9]+)")
    set(name "${CMAKE_MATCH_1}")
    if(current)
      set(name "${current}_${name}")
    endif()
  endif()
  foreach(b IN LISTS braces)
    if(b STREQUAL "{")
      list(APPEND stack "${name}")
      if(NOT name STREQUAL "-")
        list(APPEND structs "${name}")
        set(fields_${name} "")
        set(skipped_${name} "")
      endif()
      set(name "-")
    else()
      list(LENGTH stack depth)
      if(depth EQUAL 0)
        message(FATAL_ERROR "${SCHEMA}: unbalanced '}' in: ${line}")
      endif()
      list(POP_BACK stack)
    endif()
  endforeach()
endforeach()
list(LENGTH stack depth)
if(NOT depth EQUAL 0)
  message(FATAL_ERROR "${SCHEMA}: unbalanced braces (${depth} left open)")
endif()
if(NOT structs)
  message(FATAL_ERROR "${SCHEMA}: no structs found")
endif()

get_filename_component(schema_name "${SCHEMA}" NAME)
set(out "// Generated from ${schema_name} by gen_fields.cmake at build time: do not edit.
// Per struct, its plain fields in schema order: X(cxx_type, snake_name, CamelName, \"description\").
// Lists and struct fields are not listed (named in a comment under each list).
#pragma once
")
foreach(s IN LISTS structs)
  string(REPLACE "_" "::" cxx "${s}")
  # ModelLayout_Slice -> MODEL_LAYOUT_SLICE: snake the parts, not the joined name.
  string(REPLACE "_" ";" parts "${s}")
  set(macro "EXPERTD")
  foreach(p IN LISTS parts)
    to_snake(ps "${p}")
    string(TOUPPER "${ps}" ps)
    string(APPEND macro "_${ps}")
  endforeach()
  string(APPEND macro "_FIELDS")
  string(APPEND out "\n// ${cxx}")
  if(skipped_${s})
    string(REPLACE ";" ", " names "${skipped_${s}}")
    string(APPEND out " (not listed: ${names})")
  endif()
  string(APPEND out "\n#define ${macro}(X)${fields_${s}}\n")
endforeach()

# Every field of every struct, lists and nested structs included, with its trailing comment:
# X("Struct_Nested", "camelName", "description") (expertctl metrics' HELP lines).
string(REPLACE "<SEMI>" ";" docs "${docs}")
string(REPLACE "<LBR>" "[" docs "${docs}")
string(REPLACE "<RBR>" "]" docs "${docs}")
string(APPEND out "\n// Every field of every struct (lists and structs too): X(\"Struct\", \"camelName\", \"description\").
#define EXPERTD_ALL_FIELD_DOCS(X)${docs}\n")

file(WRITE "${OUTPUT}.tmp" "${out}")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
