# The Debian package (CPack, generator DEB): everything cmake/install.cmake
# and the components install, with the prefix /usr, as one package `ztier`
# (ztier_<version>_amd64.deb). scripts/package.sh configures the build it
# wants (build/package: Release, prefix /usr, CUDA off, no tests) and runs
# cpack there; tests/install/package_check.sh inspects the result.
#
# Built without CUDA: every dependency is then a Debian 12 package, found by
# dpkg-shlibdeps (liburing2, libtbb12, libhwloc15, libhwy1, libc6, ...);
# the CUDA runtime and NCCL are not Debian packages. cmake/cpack_checks.cmake
# refuses a CUDA build, or a prefix other than /usr, when cpack runs.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME ztier)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "tiered-memory offload engine for training (pinned DRAM + NVMe, CPU AdamW)")
set(CPACK_PACKAGE_DESCRIPTION
    "ztier keeps a training job's fp32 master weights and AdamW moments in pinned host DRAM or on
NVMe swap space and runs a SIMD CPU AdamW over them, while GPU processes run ZeRO stage-3
forward/backward with bf16 params streamed in and grads streamed out.

This package holds ztierd, the per-node service (systemd socket activation; user and group
ztier, group ztier-admin), ztierctl, ztier-train and ztier-bench, libztier (the C ABI), and the
headers, static libraries, CMake package and pkg-config files of the C++ API. Built without
CUDA: the device backend is the host one.")
set(ZTIER_PACKAGE_MAINTAINER "ztier maintainers <maintainers@ztier.invalid>"
    CACHE STRING "The Debian package's Maintainer field")
set(CPACK_PACKAGE_CONTACT "${ZTIER_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
# Depends: what dpkg-shlibdeps finds for the programs and libztier.so, plus
# a way to create the accounts of sysusers.d/ztier.conf (postinst).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser | systemd-sysusers")
# A shlibs file for libztier.so.0, so that packages built against it
# depend on this version or later.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
# The C++ API's static libraries link these (ztier.pc, ztierConfig.cmake).
set(CPACK_DEBIAN_PACKAGE_SUGGESTS
    "liburing-dev, libhwloc-dev, libtbb-dev, libhwy-dev, nlohmann-json3-dev, pkg-config")
# DESTDIR staging: the install runs with the prefix /usr itself, so the
# files written at install time (ExecStart=, the .pc files) say /usr, and
# the config's absolute /etc/ztier lands in the package.
set(CPACK_SET_DESTDIR ON)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_ZTIER_HAVE_CUDA ${ZTIER_HAVE_CUDA})
set(CPACK_ZTIER_CONFIGURED_PREFIX ${CMAKE_INSTALL_PREFIX})
set(CPACK_PROJECT_CONFIG_FILE ${CMAKE_CURRENT_LIST_DIR}/cpack_checks.cmake)

# Maintainer scripts (deploy/debian/) and the control files made here:
# conffiles (the config, kept across upgrades and changes) and the ldconfig
# trigger for libztier.so (CPack's own postinst/postrm give way to ours).
set(ztier_deb_dir ${PROJECT_BINARY_DIR}/install/debian)
file(MAKE_DIRECTORY ${ztier_deb_dir})
if(IS_ABSOLUTE "${ZTIER_CONFIG_DIR}")  # cmake/install.cmake: /etc/ztier with the prefix /usr
  set(ztier_conffile ${ZTIER_CONFIG_DIR}/ztierd.json)
else()
  set(ztier_conffile ${CMAKE_INSTALL_PREFIX}/${ZTIER_CONFIG_DIR}/ztierd.json)
endif()
file(WRITE ${ztier_deb_dir}/conffiles "${ztier_conffile}\n")
file(WRITE ${ztier_deb_dir}/triggers "activate-noawait ldconfig\n")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/postinst
    ${PROJECT_SOURCE_DIR}/deploy/debian/prerm
    ${PROJECT_SOURCE_DIR}/deploy/debian/postrm
    ${ztier_deb_dir}/conffiles
    ${ztier_deb_dir}/triggers)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)

include(CPack)
