#include "engine/launch.h"

#include <cstdio>
#include <cstdlib>

#include "core/error.h"

#ifdef TPMOE_WITH_MPI
#include <mpi.h>
#endif

namespace tpmoe {

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

#ifdef TPMOE_WITH_MPI
void mpi_check(int rc, const char* what) { TPMOE_CHECK(rc == MPI_SUCCESS, "MPI: {} failed (error {})", what, rc); }

// MPI_Finalize after main returns (and after the engine, with its NCCL communicator, is gone).
struct MpiSession {
  MpiWorld world;
  MpiSession() {
    int provided = 0;
    mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    MPI_Comm_rank(MPI_COMM_WORLD, &world.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world.size);
    world.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", world.rank);
    if (world.rank != 0) std::freopen("/dev/null", "w", stdout);
  }
  ~MpiSession() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};
#endif

}  // namespace

bool launched_by_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

const MpiWorld& mpi_world() {
#ifdef TPMOE_WITH_MPI
  static MpiSession session;
  return session.world;
#else
  TPMOE_FAIL(
      "started under mpirun ({} processes) but this build has no MPI: reconfigure with OpenMPI installed "
      "(libopenmpi-dev), or use one process with --tp N",
      env_int("OMPI_COMM_WORLD_SIZE", 0));
#endif
}

void mpi_broadcast(void* data, size_t bytes, int root) {
#ifdef TPMOE_WITH_MPI
  mpi_world();
  mpi_check(MPI_Bcast(data, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
#else
  (void)data, (void)bytes, (void)root;
  mpi_world();
#endif
}

void mpi_allgather(const void* mine, void* all, size_t bytes) {
#ifdef TPMOE_WITH_MPI
  mpi_world();
  mpi_check(MPI_Allgather(mine, int(bytes), MPI_BYTE, all, int(bytes), MPI_BYTE, MPI_COMM_WORLD), "MPI_Allgather");
#else
  (void)mine, (void)all, (void)bytes;
  mpi_world();
#endif
}

void mpi_abort(const char* message) {
  std::fprintf(stderr, "error: %s\n", message);
  std::fflush(stderr);
#ifdef TPMOE_WITH_MPI
  MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  std::abort();
}

}  // namespace tpmoe
