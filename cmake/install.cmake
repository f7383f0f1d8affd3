# What `cmake --install` puts under the prefix (GNUInstallDirs), included by
# the top-level CMakeLists.txt after the components:
#
#   include/ztier/ztier.h, ztier_c.h      the C++ API and the C ABI
#   include/ztier/{common,cpu_adam,...}/  the project headers ztier.h includes
#   lib*/libztier.so.0 (+ soname links)   the C ABI (ztier::ztier_c, ztier_c.pc)
#   lib*/libztier_*.a                     the C++ API, static (ztier::ztier, ztier.pc)
#   lib*/cmake/ztier/                     find_package(ztier CONFIG)
#   lib*/pkgconfig/ztier.pc, ztier_c.pc   pkg-config
#   bin/ztierd, ztierctl, ztier-bench, ztier-train
#   lib/systemd/system/ztierd.{service,socket}, lib/sysusers.d, lib/tmpfiles.d
#   etc/ztier/ztierd.json                 (/etc/ztier with the prefix /usr)
#
# The project's headers include each other as "common/status.h", so they
# keep their paths under include/ztier/ and the exported targets carry both
# <prefix>/include (for <ztier/ztier.h>) and <prefix>/include/ztier.
# Files that name installed paths (the service's ExecStart=, the .pc files)
# are written at install time, from the prefix of that install (`cmake
# --install --prefix DIR`, or CPack's /usr), by install_time_files.cmake.
# tests/install/install_test.sh installs a build tree and builds consumers
# against it, both ways.
include(CMakePackageConfigHelpers)

# ---- Headers ----
# The project headers client/ztier.h includes, directly or not (ztier_c.h
# includes none): `g++ -MM` of ztier.h. tests/install checks this list
# against the compiler's, both ways, and names what to add or drop.
set(ZTIER_INSTALLED_HEADERS
  common/bf16.h
  common/status.h
  common/unique_fd.h
  cpu_adam/adamw.h
  cpu_adam/hyper.h
  engine/dram_pool.h
  engine/engine.h
  engine/settings.h
  engine/wire_types.h
  nvme/io_backend.h)
install(FILES client/ztier.h client/ztier_c.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ztier)
foreach(header IN LISTS ZTIER_INSTALLED_HEADERS)
  get_filename_component(subdir ${header} DIRECTORY)
  install(FILES ${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ztier/${subdir})
endforeach()

# ---- Libraries and the CMake package ----
# ztier::ztier is the C++ API (ztier_client and the static libraries under
# it), ztier::ztier_c the shared C ABI; the others keep short names
# (ztier::engine, ztier::cpu_adam, ...) for programs that use a component
# alone. Their private dependencies (liburing, hwloc, oneTBB, Highway,
# nlohmann_json, CUDA) are link-only in the export and found again by
# ztierConfig.cmake.
set(ztier_static_libs ztier_client ztier_engine ztier_wire ztier_state_files ztier_nvme
                      ztier_cpu_adam ztier_common)
set_target_properties(ztier_client PROPERTIES EXPORT_NAME ztier)
set_target_properties(ztier PROPERTIES EXPORT_NAME ztier_c)
foreach(lib IN ITEMS ztier_engine ztier_wire ztier_state_files ztier_nvme ztier_cpu_adam ztier_common)
  string(REGEX REPLACE "^ztier_" "" short ${lib})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${short})
endforeach()
# NCCL is found by path (the top-level CMakeLists.txt), not as a package:
# its interface target travels in the export with those paths.
if(TARGET ztier_nccl)
  set_target_properties(ztier_nccl PROPERTIES EXPORT_NAME nccl)
  list(APPEND ztier_static_libs ztier_nccl)
endif()
install(TARGETS ${ztier_static_libs} EXPORT ztierTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${CMAKE_INSTALL_INCLUDEDIR}/ztier)
install(TARGETS ztier EXPORT ztierTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

set(ztier_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/ztier)
install(EXPORT ztierTargets NAMESPACE ztier:: DESTINATION ${ztier_cmake_dir})
configure_package_config_file(cmake/ztierConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/install/ztierConfig.cmake
                              INSTALL_DESTINATION ${ztier_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/install/ztierConfigVersion.cmake
                                 COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/install/ztierConfig.cmake
              ${PROJECT_BINARY_DIR}/install/ztierConfigVersion.cmake
        DESTINATION ${ztier_cmake_dir})

# ---- Programs ----
# ztierd, ztier-bench and ztier-train are installed by their folders;
# ztierctl here, where it is built.
if(TARGET ztierctl)
  install(TARGETS ztierctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# ---- The service: units, accounts, runtime directory, default config ----
# The config goes to /etc/ztier with the prefix /usr (and /etc/opt/... with
# /opt/...: GNUInstallDirs' FULL_SYSCONFDIR), else under the prefix, so that
# `cmake --install --prefix DIR` of a default build stays inside DIR.
if(IS_ABSOLUTE "${CMAKE_INSTALL_SYSCONFDIR}"
   OR NOT CMAKE_INSTALL_FULL_SYSCONFDIR STREQUAL "${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_SYSCONFDIR}")
  set(ZTIER_CONFIG_DIR ${CMAKE_INSTALL_FULL_SYSCONFDIR}/ztier)
else()
  set(ZTIER_CONFIG_DIR ${CMAKE_INSTALL_SYSCONFDIR}/ztier)
endif()
install(FILES deploy/ztierd.json DESTINATION ${ZTIER_CONFIG_DIR})
install(FILES deploy/sysusers.d/ztier.conf DESTINATION lib/sysusers.d)
install(FILES deploy/tmpfiles.d/ztier.conf DESTINATION lib/tmpfiles.d)

set(ztier_units ztierd.service ztierd.socket)
if(EXISTS ${PROJECT_SOURCE_DIR}/deploy/ztierd-metrics.socket)
  list(APPEND ztier_units ztierd-metrics.socket)
endif()

# Written at install time into the build tree, then installed like any file.
set(ztier_generated ${PROJECT_BINARY_DIR}/install/generated)
set(ztier_unit_files ${ztier_units})
list(TRANSFORM ztier_unit_files PREPEND ${ztier_generated}/)
if(ZTIER_HAVE_CUDA)
  # Link-only dependencies of the static libraries that have no .pc file.
  set(ztier_pc_cuda_libs "-L${CUDAToolkit_LIBRARY_DIR} -lcudart")
  if(TARGET ztier_nccl)
    string(APPEND ztier_pc_cuda_libs " ${NCCL_LIBRARY}")
  endif()
endif()
install(CODE "
  set(ZTIER_SOURCE_DIR \"${PROJECT_SOURCE_DIR}\")
  set(ZTIER_OUT_DIR \"${ztier_generated}\")
  set(ZTIER_VERSION \"${PROJECT_VERSION}\")
  set(ZTIER_UNITS \"${ztier_units}\")
  set(ZTIER_BINDIR \"${CMAKE_INSTALL_BINDIR}\")
  set(ZTIER_LIBDIR \"${CMAKE_INSTALL_LIBDIR}\")
  set(ZTIER_INCLUDEDIR \"${CMAKE_INSTALL_INCLUDEDIR}\")
  set(ZTIER_CONFIG_DIR \"${ZTIER_CONFIG_DIR}\")
  set(ZTIER_PC_CUDA_LIBS \"${ztier_pc_cuda_libs}\")
  include(\"${CMAKE_CURRENT_LIST_DIR}/install_time_files.cmake\")")
install(FILES ${ztier_unit_files} DESTINATION lib/systemd/system)
install(FILES ${ztier_generated}/ztier.pc ${ztier_generated}/ztier_c.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
