// The aarch64 half of `python -m minivllm_support.arm_check`: it runs under qemu-aarch64, loads
// one cross-built kernel library (the same .so the project's builder makes, only for ARM), makes
// one call described by a small text file, and writes the outputs back as raw files, which the
// Python half compares with torch's reference numbers on the host.
//
// usage: arm_check <library.so> <call.txt>      (run in the folder that holds the call's files)
//
// call.txt: the function's name and what it returns (void, i64 or str) on the first line, then
// one line per argument, in the C signature's order:
//   in NAME       pointer to the bytes of NAME.bin
//   io NAME       the same, written back to NAME.out after the call (a pool written in place)
//   out NAME N    pointer to N bytes set to 0xFF (NaN in float32 and bf16, -1 in int64, so an
//                 element the kernel forgot to write cannot pass), written to NAME.out
//   null          a null pointer
//   i64 X, f32 X  a scalar (f32 as a hex float: the exact value Python computed)
// It prints `isa=...` (kernel_isa(), where the library exports it) and, for a non-void
// function, `ret=...`. Exit status 3: the library does not export the function.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace {

using P = void*;
using I = int64_t;

struct Buffer {
  std::string name;  // written back to name + ".out" when non-empty
  char* data;
  size_t size;
};

char* alloc(size_t n) {  // 64-byte aligned, as torch's allocator gives the Python bindings
  void* p = std::aligned_alloc(64, (n + 63) / 64 * 64 + 64);
  if (!p) std::exit(4);
  return static_cast<char*>(p);
}

Buffer read_file(const std::string& name) {
  std::ifstream f(name + ".bin", std::ios::binary);
  if (!f) {
    std::cerr << "cannot read " << name << ".bin\n";
    std::exit(4);
  }
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  char* p = alloc(bytes.size());
  std::memcpy(p, bytes.data(), bytes.size());
  return {"", p, bytes.size()};
}

struct Args {  // the arguments by kind, each in signature order
  std::vector<P> p;
  std::vector<I> i;
  std::vector<float> f;
};

// One cast per C signature. The kernels take typed pointers (const uint16_t*, float*, ...);
// calling them through void* is what ctypes does too: on AArch64 every pointer is passed the same way.
bool call(void* fn, const std::string& name, const Args& a, const std::string& ret) {
  auto starts = [&](const char* prefix) { return name.rfind(prefix, 0) == 0; };
  const auto& p = a.p;
  const auto& i = a.i;
  const auto& f = a.f;
  if (ret == "i64") {
    std::cout << "ret=" << reinterpret_cast<I (*)()>(fn)() << "\n";
  } else if (ret == "str") {
    std::cout << "ret=" << reinterpret_cast<const char* (*)()>(fn)() << "\n";
  } else if (starts("paged_decode_")) {
    reinterpret_cast<void (*)(P, P, P, P, P, P, P, I, I, I, I, I, I, I, float)>(fn)(
        p[0], p[1], p[2], p[3], p[4], p[5], p[6], i[0], i[1], i[2], i[3], i[4], i[5], i[6], f[0]);
  } else if (starts("flash_attention_") || starts("flash_decode_")) {
    reinterpret_cast<void (*)(P, P, P, P, P, P, P, I, I, I, I, I, I, float, I)>(fn)(
        p[0], p[1], p[2], p[3], p[4], p[5], p[6], i[0], i[1], i[2], i[3], i[4], i[5], f[0], i[6]);
  } else if (name == "qk_norm_rope_bf16") {
    reinterpret_cast<void (*)(P, I, I, I, I, I, P, P, P, P, float, P, P)>(fn)(
        p[0], i[0], i[1], i[2], i[3], i[4], p[1], p[2], p[3], p[4], f[0], p[5], p[6]);
  } else if (name == "silu_mul_bf16") {
    reinterpret_cast<void (*)(P, I, I, P)>(fn)(p[0], i[0], i[1], p[1]);
  } else if (name == "write_kv") {
    reinterpret_cast<void (*)(P, P, I, I, I, I, I, P, P, P, I, I)>(fn)(
        p[0], p[1], i[0], i[1], i[2], i[3], i[4], p[2], p[3], p[4], i[5], i[6]);
  } else if (name == "row_argmax_f32") {
    reinterpret_cast<void (*)(P, I, I, I, P)>(fn)(p[0], i[0], i[1], i[2], p[1]);
  } else {
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: arm_check <library.so> <call.txt>\n";
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::cerr << "dlopen: " << dlerror() << "\n";
    return 4;
  }
  if (auto isa = reinterpret_cast<const char* (*)()>(dlsym(lib, "kernel_isa"))) std::cout << "isa=" << isa() << "\n";

  std::ifstream spec(argv[2]);
  std::string name, ret, line;
  spec >> name >> ret;
  void* fn = dlsym(lib, name.c_str());
  if (!fn) {
    std::cout << "missing=" << name << "\n";
    return 3;
  }
  Args args;
  std::vector<Buffer> buffers;
  while (std::getline(spec, line)) {
    std::istringstream words(line);
    std::string kind, value;
    if (!(words >> kind)) continue;
    words >> value;
    if (kind == "in" || kind == "io") {
      buffers.push_back(read_file(value));
      if (kind == "io") buffers.back().name = value;
      args.p.push_back(buffers.back().data);
    } else if (kind == "out") {
      size_t n = 0;
      words >> n;
      buffers.push_back({value, alloc(n), n});
      std::memset(buffers.back().data, 0xFF, n);
      args.p.push_back(buffers.back().data);
    } else if (kind == "null") {
      args.p.push_back(nullptr);
    } else if (kind == "i64") {
      args.i.push_back(std::strtoll(value.c_str(), nullptr, 10));
    } else if (kind == "f32") {
      args.f.push_back(float(std::strtod(value.c_str(), nullptr)));
    }
  }
  if (!call(fn, name, args, ret)) {
    std::cerr << "no signature known for " << name << "\n";
    return 2;
  }
  for (const Buffer& b : buffers) {
    if (b.name.empty()) continue;
    std::ofstream out(b.name + ".out", std::ios::binary);
    out.write(b.data, std::streamsize(b.size));
  }
  return 0;
}
