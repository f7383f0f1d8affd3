# Read by cpack (CPACK_PROJECT_CONFIG_FILE, cmake/package.cmake) before it
# packages: the Debian package is made from a build configured for it
# (scripts/package.sh does): the prefix /usr, so that the libraries land in
# lib/x86_64-linux-gnu and the config in /etc/ztier, and no CUDA, whose
# runtime and NCCL are no Debian packages (dpkg-shlibdeps would find no
# package for them).
if(CPACK_GENERATOR STREQUAL "DEB")
  if(NOT CPACK_ZTIER_CONFIGURED_PREFIX STREQUAL "/usr")
    message(FATAL_ERROR "ztier: the Debian package wants a build configured with "
                        "-DCMAKE_INSTALL_PREFIX=/usr, this one has '${CPACK_ZTIER_CONFIGURED_PREFIX}' "
                        "(scripts/package.sh configures build/package)")
  endif()
  if(CPACK_ZTIER_HAVE_CUDA)
    message(FATAL_ERROR "ztier: the Debian package wants a build configured with -DZTIER_CUDA=OFF "
                        "(the CUDA runtime and NCCL are not Debian 12 packages; scripts/package.sh)")
  endif()
endif()
