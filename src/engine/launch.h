// One process per GPU under mpirun: detect the launch, initialise MPI once, and the two collectives
// the engine needs before NCCL exists (the fingerprint all-gather, the NCCL unique id broadcast).
// All MPI calls of tpmoe live in mpi_launch.cpp; without TPMOE_WITH_MPI a run under mpirun fails
// with a clear message instead of running N independent copies.
#pragma once

#include <cstddef>

namespace tpmoe {

struct MpiWorld {
  int rank = 0, size = 1;
  int local_rank = 0;  // this process's GPU on its host
};

// True when started by mpirun/mpiexec (OpenMPI sets OMPI_COMM_WORLD_SIZE).
bool launched_by_mpi();

// Initialises MPI on first use (finalised at exit) and returns this process's place. On ranks other
// than 0, stdout goes to /dev/null from here on: only rank 0 prints results; errors (stderr) stay.
const MpiWorld& mpi_world();

void mpi_broadcast(void* data, size_t bytes, int root);
// all[r * bytes ...] <- rank r's `mine`.
void mpi_allgather(const void* mine, void* all, size_t bytes);
// A rank that failed while its peers may be blocked in a collective: print, then end the whole job.
[[noreturn]] void mpi_abort(const char* message);

}  // namespace tpmoe
