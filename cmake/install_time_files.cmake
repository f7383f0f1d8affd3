# Run by `cmake --install` (an install(CODE) rule of cmake/install.cmake),
# before the install rules that copy what it writes: the files that name
# installed paths, made from the prefix of this install, which may differ
# from the configured one (`cmake --install --prefix DIR`; CPack installs
# with the prefix /usr under DESTDIR, so the package's files say /usr).
#
#   ${ZTIER_OUT_DIR}/<unit>        deploy/<unit> with ExecStart= pointing at
#                                  the installed ztierd and its config
#   ${ZTIER_OUT_DIR}/ztier.pc      cmake/ztier.pc.in
#   ${ZTIER_OUT_DIR}/ztier_c.pc    cmake/ztier_c.pc.in
#
# In: CMAKE_INSTALL_PREFIX (this install's), ZTIER_SOURCE_DIR, ZTIER_OUT_DIR,
# ZTIER_VERSION, ZTIER_UNITS, ZTIER_BINDIR, ZTIER_LIBDIR, ZTIER_INCLUDEDIR,
# ZTIER_CONFIG_DIR (each relative to the prefix, or absolute),
# ZTIER_PC_CUDA_LIBS.

# `dir` as an absolute path under this install's prefix.
function(ztier_installed_path out dir)
  if(IS_ABSOLUTE "${dir}")
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    string(REGEX REPLACE "/$" "" prefix "${CMAKE_INSTALL_PREFIX}")
    set(${out} "${prefix}/${dir}" PARENT_SCOPE)
  endif()
endfunction()

ztier_installed_path(bindir "${ZTIER_BINDIR}")
ztier_installed_path(config_dir "${ZTIER_CONFIG_DIR}")
# systemd reads '%' as a specifier and splits ExecStart= at spaces.
if(NOT "${bindir}${config_dir}" MATCHES "^[A-Za-z0-9._/+-]+$")
  message(FATAL_ERROR "ztier: the units' paths '${bindir}' and '${config_dir}' must be "
                      "absolute paths of letters, digits and ._/+- (ExecStart=)")
endif()

file(MAKE_DIRECTORY "${ZTIER_OUT_DIR}")
# The units in deploy/ name /usr/local/bin/ztierd and /etc/ztier/ztierd.json
# (deploy/install.sh substitutes the binary's path the same way).
foreach(unit IN LISTS ZTIER_UNITS)
  file(READ "${ZTIER_SOURCE_DIR}/deploy/${unit}" text)
  string(REPLACE "/usr/local/bin/ztierd" "${bindir}/ztierd" text "${text}")
  string(REPLACE "/etc/ztier/ztierd.json" "${config_dir}/ztierd.json" text "${text}")
  file(WRITE "${ZTIER_OUT_DIR}/${unit}" "${text}")
endforeach()

# pkg-config: the variables the .pc templates name; libdir and includedir
# relative to ${prefix} where they are (--define-variable=prefix=... works).
string(REGEX REPLACE "(.)/$" "\\1" ZTIER_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
foreach(kind IN ITEMS LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${ZTIER_${kind}}")
    set(ZTIER_PC_${kind} "${ZTIER_${kind}}")
  else()
    set(ZTIER_PC_${kind} "\${prefix}/${ZTIER_${kind}}")
  endif()
endforeach()
foreach(pc IN ITEMS ztier.pc ztier_c.pc)
  configure_file("${ZTIER_SOURCE_DIR}/cmake/${pc}.in" "${ZTIER_OUT_DIR}/${pc}" @ONLY)
endforeach()
